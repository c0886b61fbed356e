"""Shared by the benchmark scripts: machine facts, versions, and writing a JSON receipt."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def cpu_model() -> dict:
    """The CPU's model name and its bf16 flags (``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    names = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln]
    flags = sorted({"avx512_bf16", "amx_bf16", "amx_tile", "avx512f"} & set(text.split()))
    return {"cpu_model": names[0] if names else None, "cpu_bf16_flags": flags}


def machine() -> dict:
    import torch

    return {
        **cpu_model(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }


@contextlib.contextmanager
def local_server(model: str | Path, tmp: str | Path, wait: float = 300, dtype: str = "auto"):
    """Our torch server for ``model`` on a free loopback port (CPU, ``--dtype``), stopped on
    exit."""
    from rlcli.demo.run import free_port
    from rlcli.launch import process
    from rlcli.launch import torch_server as torch_backend

    home = Path(tmp) / "home"
    opts = torch_backend.TorchServerOptions(
        base_model=str(model), port=free_port(), device="cpu", dtype=dtype
    )
    record, healthy = torch_backend.start(home, opts, wait=wait)
    try:
        if not healthy:
            raise RuntimeError(f"the server did not become healthy; see {record.log_path}")
        yield record
    finally:
        process.stop(home)


def timed(step, n: int) -> list[float]:
    """Seconds taken by each of ``n`` calls of ``step()``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def summary(samples: list[float]) -> dict:
    return {
        "median": statistics.median(samples),
        "mean": statistics.fmean(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def write(name: str, payload: dict) -> Path:
    from rlcli.versions import installed_versions

    RESULTS.mkdir(parents=True, exist_ok=True)
    receipt = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "versions": installed_versions(),
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(receipt, indent=2) + "\n")
    return path

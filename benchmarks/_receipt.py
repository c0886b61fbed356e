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
        "cpu_kind": cpu_kind(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        # how busy the machine was as the receipt was written (timings on shared cores vary)
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, a job stopped) raises SystemExit, so ``local_server``'s ``finally``
    stops the server it started instead of leaving it running (it has a session of its own)."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def cpu_kind() -> str:
    """What bf16 costs on this CPU: ``AVX512-BF16`` (bf16 arithmetic, with or without AMX),
    ``AVX2`` (bf16 emulated, slower than float32) or ``other``."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "other"
    if {"avx512_bf16", "amx_bf16"} & flags:
        return "AVX512-BF16" + ("+AMX" if "amx_bf16" in flags else "")
    return "AVX2" if "avx2" in flags else "other"


@contextlib.contextmanager
def local_server(
    model: str | Path,
    tmp: str | Path,
    wait: float = 300,
    dtype: str = "auto",
    device: str = "cpu",
    extra_args: list[str] | tuple[str, ...] = (),
    checkpoints_dir: str | Path = "",
):
    """Our torch server for ``model`` on a free loopback port (``--device``, ``--dtype``, then
    ``extra_args`` as given, e.g. ``["--no-compile"]``), stopped on exit. The server inherits
    this environment (``RLCLI_*`` variables included); ``checkpoints_dir``: where it keeps
    checkpoints (default: ``$RLCLI_HOME/checkpoints``, as ``serve start``)."""
    from rlcli.demo.run import free_port
    from rlcli.launch import process
    from rlcli.launch import torch_server as torch_backend

    home = Path(tmp) / "home"
    opts = torch_backend.TorchServerOptions(
        base_model=str(model), port=free_port(), device=device, dtype=dtype,
        checkpoints_dir=str(checkpoints_dir),
    )  # fmt: skip
    launch = torch_backend.launch(opts)
    launch.command = [*launch.command, *extra_args]
    record, healthy = process.start_detached(home, launch, wait=wait)
    try:
        if not healthy:
            raise RuntimeError(f"the server did not become healthy; see {record.log_path}")
        yield record
    finally:
        process.stop(home)


def server_status(base_url: str) -> dict | None:
    """``/rlcli/status`` as the server reports it (its engine's settings: dtype, micro-batch
    tokens, compile times), None where it does not answer."""
    import httpx

    try:
        reply = httpx.get(f"{base_url}/rlcli/status", timeout=10)
        return reply.json() if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


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

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


def machine() -> dict:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }


@contextlib.contextmanager
def local_server(model: str | Path, tmp: str | Path, wait: float = 300):
    """Our torch server for ``model`` on a free loopback port (CPU), stopped on exit."""
    from rlcli.backends import process
    from rlcli.backends import torch as torch_backend
    from rlcli.demo import free_port

    home = Path(tmp) / "home"
    opts = torch_backend.TorchServerOptions(base_model=str(model), port=free_port(), device="cpu")
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

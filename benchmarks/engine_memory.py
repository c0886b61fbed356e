"""The engine's training memory at its defaults vs the defaults before issue 46, in one process.

SmolLM2-135M-Instruct in bf16 on a CPU (the engine's choice on AVX512-BF16/AMX), LoRA rank 32 on
every layer, forward_backward + optim_step (the engine process's allocator settings). Two
shapes: ``sl``, 8 x 256-token rows, cross_entropy (``sft_step_smollm2.py``'s step); ``rl``, 4
GSM8K-sized prompts (230 tokens) x 4 answers of 120-255 tokens, importance_sampling
(``trl_peer.py --part rl``'s training half; random tokens: a step's work does not depend on
them). Configurations: ``now`` (the defaults: 512-token micro-batches since 2026-12-04, 1024
in the receipt of 2026-12-04 02:22; bf16 copies of what
the backward reads: ``server/engine/activations.py``) and ``before`` (4096-token
micro-batches, float32 saved tensors: what a 23 GB machine's free memory gave). Peak RSS is
the process's VmHWM after one step of ``now``, then after one step of ``before`` (which peaks
higher, so each reading is its configuration's). Time is the process's CPU seconds per step
on one thread, the two configurations alternated: on a shared machine CPU time moves less
than wall time with the neighbours' load. Usage:

    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/engine_memory.py [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_model  # noqa: E402


def peak_gb() -> float:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def batches(kind: str, count: int, seed: int = 0) -> list[tuple[list, str]]:
    import numpy as np

    from rlcli.server.wire import DatumArrays

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        data = []
        if kind == "sl":
            for _ in range(8):
                tokens, targets = rng.integers(0, 49000, 256), rng.integers(0, 49000, 256)
                weights = np.ones(256, np.float32)
                data.append(DatumArrays(tokens, {"target_tokens": targets, "weights": weights}))
            out.append((data, "cross_entropy"))
            continue
        for _ in range(4):
            prompt = rng.integers(0, 49000, 230)
            for _ in range(4):
                answer = rng.integers(0, 49000, int(rng.integers(120, 256)))
                tokens = np.concatenate([prompt, answer])
                w = np.concatenate([np.zeros(len(prompt) - 1), np.ones(len(answer))])
                advantage = (rng.standard_normal() * w).astype(np.float32)
                inputs = {"target_tokens": tokens[1:], "logprobs": (-w).astype(np.float32)}
                data.append(DatumArrays(tokens[:-1], {**inputs, "advantages": advantage}))
        out.append((data, "importance_sampling"))
    return out


def measure(model: Path, kind: str, steps: int) -> dict:
    """One shape, in a child process of its own (``--child``), so its peaks are its own."""
    import json
    import subprocess

    command = [sys.executable, __file__, "--child", kind, "--model", str(model)]
    done = subprocess.run(
        [*command, "--steps", str(steps)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(model: Path, kind: str, steps: int) -> dict:
    import torch

    from rlcli.server.engine import allocator, hardware
    from rlcli.server.engine.core import Engine

    torch.set_num_threads(1)
    allocator.keep_freed_memory()  # as the engine process does
    engine = Engine(str(model), device="cpu", dtype="bfloat16")
    engine.create_adapter("a", rank=32, seed=0)
    configs = {"now": (hardware.CPU_MICROBATCH_TOKENS, True), "before": (4096, False)}

    def use(name: str) -> None:
        tokens, compact = configs[name]
        engine.microbatch_tokens = engine._checkpoint_above = tokens  # (CPU: auto)
        engine._compact_activations = compact

    work = batches(kind, steps)

    def step(i: int) -> float:
        data, loss = work[i % len(work)]
        t0 = time.process_time()
        engine.forward_backward("a", data, loss)
        engine.optim_step("a", 1e-6)
        return time.process_time() - t0

    result = {"loaded_peak_rss_gb": peak_gb()}
    for name in configs:  # now first: it peaks lower
        use(name)
        step(0)
        result[f"{name}_peak_rss_gb"] = peak_gb()
        print(f"{kind} {name}: peak {result[f'{name}_peak_rss_gb']:.2f} GB", file=sys.stderr)
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    for i in range(steps):
        for name in configs if i % 2 == 0 else reversed(list(configs)):
            use(name)
            cpu[name].append(step(i))
    result["configs"] = {
        name: {"microbatch_tokens": t, "bf16_saved_activations": c}
        for name, (t, c) in configs.items()
    }
    result["tokens_per_step"] = sum(len(d.tokens) for d in work[0][0])
    result["cpu_s_per_step"] = cpu
    result["now_over_before_cpu"] = statistics.median(cpu["now"]) / statistics.median(cpu["before"])
    result["now_over_before_peak"] = result["now_peak_rss_gb"] / result["before_peak_rss_gb"]
    return result


def main() -> None:
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--shapes", default="sl,rl")
    parser.add_argument("--name", default="engine_memory")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = smollm2_model(args.model)
    if args.child:
        print(json.dumps(child(model, args.child, args.steps)))
        return
    payload = {"what": __doc__.split("\n\n")[0], "model": str(model), "threads": 1}
    for kind in args.shapes.split(","):
        payload[kind] = measure(model, kind, args.steps)
        path = _receipt.write(args.name, payload)
        print(kind, json.dumps(payload[kind]), flush=True)
    print(path)


if __name__ == "__main__":
    main()

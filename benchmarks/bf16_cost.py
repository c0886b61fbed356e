"""What bf16 with float32 results (``server/engine/precision.py``) costs against plain bf16 and
float32: SmolLM2-135M-Instruct, in-process Engine, the RL benchmark's shapes (4 arithmetic
prompts x 8 rollouts at T 0.8, 24 tokens; then one importance-sampling forward+backward on them).

Three variants in one process, interleaved, ``--reps`` times each (2 shared cores: compare the
same rep's numbers): ``float32`` (its own engine), ``bf16_mixed`` (what the engine does now)
and ``bf16_plain`` (the same bf16 engine with its Linears set back to torch's, i.e. before).

    .venv/bin/python benchmarks/bf16_cost.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from bf16_diagnosis import datums, jobs_for, prompts, rollouts  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--name", default="bf16_cost")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    args = parser.parse_args()

    from rlcli.server.engine import precision
    from rlcli.server.engine.core import Engine

    model = smollm2_model(args.model)
    ps = prompts(model, 4)
    engines = {
        "float32": Engine(str(model), device="cpu", dtype="float32"),
        "bf16": Engine(str(model), device="cpu", dtype="bfloat16"),
    }
    linears = [
        (m, type(m)) for m in engines["bf16"].model.modules() if isinstance(m, torch.nn.Linear)
    ]

    def use(variant: str) -> Engine:
        for module, kind in linears:
            module.__class__ = torch.nn.Linear if variant == "bf16_plain" else kind
        return engines["float32" if variant == "float32" else "bf16"]

    for engine in engines.values():
        engine.create_adapter("a", rank=32, seed=0)
        engine.snapshot_sampler("a", "s", None, {})
    assert {k for _, k in linears} == {precision.Bf16Linear, precision.Float32Head}
    timings: dict[str, dict[str, list[float]]] = {}
    for rep in range(args.reps):
        for variant in ("float32", "bf16_mixed", "bf16_plain"):
            engine = use(variant)
            jobs = jobs_for(ps, "s", 8, 24, 0.8, 100 + rep)
            t0 = time.perf_counter()
            rows = rollouts(engine, jobs)
            sample_s = time.perf_counter() - t0
            tokens = sum(len(t) for _, t, _ in rows)
            data = datums(rows, np.tile([1.0, -1.0], len(rows) // 2))
            t0 = time.perf_counter()
            engine.forward_backward("a", data, "importance_sampling")
            train_s = time.perf_counter() - t0
            engine.adapters["a"].optimizer.zero_grad(set_to_none=True)
            t = timings.setdefault(variant, {"sample_s": [], "sampled_tokens": [], "fwd_bwd_s": []})
            t["sample_s"].append(sample_s)
            t["sampled_tokens"].append(tokens)
            t["fwd_bwd_s"].append(train_s)
            print(rep, variant, f"sample {sample_s:.2f}s ({tokens} tok)", f"fwd+bwd {train_s:.2f}s")
    use("bf16_mixed")
    med = {v: {k: float(np.median(x)) for k, x in t.items()} for v, t in timings.items()}
    ratios = {
        "mixed_over_plain_sample": med["bf16_mixed"]["sample_s"] / med["bf16_plain"]["sample_s"],
        "mixed_over_plain_fwd_bwd": med["bf16_mixed"]["fwd_bwd_s"] / med["bf16_plain"]["fwd_bwd_s"],
        "mixed_over_fp32_sample": med["bf16_mixed"]["sample_s"] / med["float32"]["sample_s"],
        "mixed_over_fp32_fwd_bwd": med["bf16_mixed"]["fwd_bwd_s"] / med["float32"]["fwd_bwd_s"],
    }
    receipt = {
        "what": "seconds to sample 32 rollouts (24 tokens) and to run one importance-sampling "
        "forward+backward on them, SmolLM2-135M-Instruct on CPU: float32, bf16 with float32 "
        "results (now), plain bf16 (before)",
        "note": "2 cores shared with other jobs: raw timings per rep, medians, ratios of medians",
        "timings": timings,
        "median": med,
        "ratios": ratios,
    }
    print(json.dumps({"median": med, "ratios": ratios}, indent=1))
    print("->", _receipt.write(args.name, receipt))


if __name__ == "__main__":
    main()

"""Where a decode step's time goes, against what 30% of the memory roofline allows: the
receipt behind issue 25's "blocked" (SmolLM2-135M-Instruct, in-process, no server).

For one precision (``--dtype``; one per run: a second model loaded in the same process
slowed the first measurements here) and each batch (``--batches``), on the server's own step
(``decode_step.LlamaStep``, eager, base model, a cache ``--positions`` long):
  - ``step_ms``: one decode step, as the server runs it;
  - ``matmuls_ms``: the step's own matmuls (fused q/k/v, o, gate/up, down per layer, then the
    output layer) one after another on the step's weights (oneDNN's packed copies on a CPU),
    nothing between them; ``projections_ms`` and ``head_ms`` split it;
  - ``rest_ms``: the step with every matmul replaced by a preallocated result of its shape:
    norms, RoPE, cache writes, attention, casts and dispatch;
  - ``budget_ms``: the step time at which the server would sit at 30% of the roofline
    (``sampling_smollm2.py``'s: weight bytes per step over the read bandwidth measured in this
    run), ignoring prefill and drawing tokens, so a generous budget;
  - ``matmul_rate_gbs``: the projections' weight bytes over ``projections_ms``.
Each is the median and the fastest of ``--reps`` runs; the verdict takes the fastest matmuls
(the most favourable reading): if they alone exceed ``budget_ms``, no work on the rest of the
step reaches the target on this machine: it needs faster matmul kernels than the ones the
step calls. These hosts are noisy: run it twice, compare ratios.

    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/decode_floor.py --name NAME
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_folder, smollm2_model  # noqa: E402
from sampling_smollm2 import read_bandwidth, weight_bytes  # noqa: E402

TARGET_PCT = 30.0
NAMES = ("qkv", "o", "gate_up", "down")  # a layer's matmuls in the step (``LayerWeights``)


def median_ms(fn, reps: int) -> dict:
    fn()  # warm-up
    samples = [1000 * s for s in _receipt.timed(fn, reps)]
    return {**_receipt.summary(samples), "raw": samples}


def measure(model_dir: str, dtype_name: str, batches: list[int], positions: int, reps: int):
    import torch
    from transformers import AutoModelForCausalLM

    from rlcli.server.engine import decode_step, precision

    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if dtype != torch.float32:
        precision.mixed_precision(model)
    step = decode_step.LlamaStep(model, positions + 64)
    proj_bytes = sum(
        getattr(w, name).numel() * getattr(w, name).element_size()
        for w in step.layers
        for name in NAMES
    )
    with torch.inference_mode():
        per_batch = {str(rows): one_batch(step, rows, positions, reps) for rows in batches}
    for r in per_batch.values():
        r["matmul_rate_gbs"] = proj_bytes / r["projections_ms"]["median"] / 1e6
    return {
        "weight_bytes_per_step": weight_bytes(model),
        "projection_bytes": proj_bytes,
        "batches": per_batch,
    }


def one_batch(step, rows: int, positions: int, reps: int) -> dict:
    import torch

    from rlcli.server.engine import decode_step

    keys, values = step.new_cache(rows, positions + 64)
    tokens = torch.randint(0, step.embed.shape[0], (rows,))
    where = torch.full((rows,), positions)
    # float32 inputs, as the step's: ``_linear`` casts them for a bf16 weight
    widths = {getattr(w, name).shape[1] for w in step.layers for name in NAMES}
    inputs = {n: torch.randn(rows, n) for n in widths}
    head_in = torch.randn(rows, step.head.shape[1])
    packed = step.uses_packed(rows)

    def projections():
        for w in step.layers:
            for name in NAMES:
                weight = getattr(w, name)
                mine = getattr(w, f"{name}_packed") if packed else None
                decode_step._linear(inputs[weight.shape[1]], weight, None, mine)

    def head():
        mine = step.head_packed if packed else None
        decode_step._linear(head_in, step.head, step.head_bias, mine)

    def run_step():
        step(tokens, where, keys, values, None, positions + 1)

    results: dict[tuple, torch.Tensor] = {}

    def stub(x, weight, bias, packed=None, upcast=True):
        """A matmul's result without the matmul (the same tensor each call)."""
        stays_low = weight.dtype != torch.float32 and not upcast
        key = (x.shape[0], weight.shape[0], stays_low)
        if key not in results:
            results[key] = torch.zeros(key[:2], dtype=weight.dtype if stays_low else torch.float32)
        return results[key]

    out = {
        "step_ms": median_ms(run_step, reps),
        "projections_ms": median_ms(projections, reps),
        "head_ms": median_ms(head, reps),
    }
    real, decode_step._linear = decode_step._linear, stub
    try:
        out["rest_ms"] = median_ms(run_step, reps)
    finally:
        decode_step._linear = real
    out["matmuls_ms"] = out["projections_ms"]["median"] + out["head_ms"]["median"]
    out["matmuls_fastest_ms"] = out["projections_ms"]["min"] + out["head_ms"]["min"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", default=None,
        help="model folder (SmolLM2 converted into it if empty; default: in $RLCLI_HOME)",
    )  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", default="8,16")
    parser.add_argument("--positions", type=int, default=128, help="cache positions attended")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--name", default="decode_floor")
    args = parser.parse_args()
    import torch

    # converted there if missing
    model_dir = str(smollm2_folder(Path(args.model_dir)) if args.model_dir else smollm2_model())
    bandwidth = [read_bandwidth(torch.device("cpu"))]
    batches = [int(b) for b in args.batches.split(",")]
    results = {args.dtype: measure(model_dir, args.dtype, batches, args.positions, args.reps)}
    bandwidth.append(read_bandwidth(torch.device("cpu")))
    best = max(b["read_bytes_per_s"] for b in bandwidth)
    for kind, result in results.items():
        roofline_ms = 1000 * result["weight_bytes_per_step"] / best
        for rows, r in result["batches"].items():
            r["roofline_ms"] = roofline_ms
            r["budget_ms"] = roofline_ms * 100 / TARGET_PCT
            r["matmuls_over_budget"] = r["matmuls_fastest_ms"] / r["budget_ms"]
            print(
                f"{kind} {rows} rows: step {r['step_ms']['median']:.1f} ms = matmuls "
                f"{r['matmuls_ms']:.1f} (projections {r['projections_ms']['median']:.1f} at "
                f"{r['matmul_rate_gbs']:.1f} GB/s, head {r['head_ms']['median']:.1f}) + rest "
                f"{r['rest_ms']['median']:.1f}; 30% of the roofline needs a step of "
                f"{r['budget_ms']:.1f} ms (the fastest matmuls alone, "
                f"{r['matmuls_fastest_ms']:.1f} ms: {r['matmuls_over_budget']:.2f}x it)",
                flush=True,
            )
    payload = {
        "what": "SmolLM2 decode step: matmuls vs the rest vs 30% of the memory roofline",
        "model": model_dir,
        "positions": args.positions,
        "bandwidth": {"read_bytes_per_s": best, "samples": bandwidth},
        "results": results,
    }
    print(_receipt.write(args.name, payload))


if __name__ == "__main__":
    main()

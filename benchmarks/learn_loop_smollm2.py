"""The continual-learning loop on SmolLM2-135M-Instruct, offline, with a JSON receipt.

A thin caller of ``rlcli demo --loop`` (``rlcli.demo.loop``), so the demo and this receipt are
one code path: SmolLM2 served behind an alias with capture on; each round fresh two-digit
additions go through ``/v1`` to the alias (captured), a scripted judge posts a verdict per
answer to ``POST /v1/feedback`` (1 for the sum, else 0 with the sum as a correction), and
``learn`` runs one round on the capture folder (held out by trace id, trained from the
alias's state, promoted only past the gate). After the rounds one is trained on shuffled
verdicts (corrections that are wrong sums): the gate must refuse it. The receipt has each
round's held-out scores, decision and seconds per phase, the capture-to-decision latency, and
the base model against the served alias on every held-out question of the honest rounds.

    PYTHONPATH=src python benchmarks/learn_loop_smollm2.py --rounds 3 --questions 48 --epochs 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _receipt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--model", help="SmolLM2 folder already converted (default: the demo's)")
    args = parser.parse_args()
    _receipt.exit_on_sigterm()

    from rlcli.demo.loop import run_loop_demo, summary_lines
    from rlcli.demo.run import DemoConfig

    tmp = Path(tempfile.mkdtemp(prefix="learn-loop-"))
    os.environ["RLCLI_HOME"] = str(tmp / "home")  # learn's folders follow $RLCLI_HOME
    config = DemoConfig(
        loop=True, base_model=args.model, rounds=args.rounds, questions=args.questions,
        epochs=args.epochs, sft_lr=args.lr, dtype=args.dtype, log_path=str(tmp / "run"),
    )  # fmt: skip
    result = {"benchmark": "learn_loop_smollm2", "machine": _receipt.machine(),
              "settings": vars(args), "rounds": []}  # fmt: skip

    def so_far(row: dict) -> None:
        result["rounds"].append(row)
        _receipt.write("learn_loop_smollm2", result)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    out = run_loop_demo(config, tmp / "home", say, on_round=so_far)
    result.update(out)
    print("\n".join(summary_lines(out)), file=sys.stderr)
    print(json.dumps(out["held_out_all"], indent=2))
    print(_receipt.write("learn_loop_smollm2", result))


if __name__ == "__main__":
    main()

"""The continual-learning loop on SmolLM2-135M-Instruct, offline, with a JSON receipt.

SmolLM2 is served behind an alias (``qa``); each round a stream of fresh arithmetic questions
goes through ``/v1`` to the alias, a scripted judge scores each answer (1 if it is the sum,
else 0 with the sum as a correction), and ``learn`` runs one round on those judged traces
(held out by trace id, trained from the alias's state, promoted only past the gate). After
the rounds, one round is trained on shuffled verdicts (corrections that are wrong sums): the
gate must refuse it. The receipt has the held-out score per round, the seconds per phase, the
served alias's score on every held-out question before the first round and after the last,
and the capture-to-promotion latency. The script writes the exchanges it made through ``/v1``
as judged rows itself (the imported-row format; the same loop through a capture folder and
``POST /v1/feedback`` is ``tests/test_learn.py``).

    PYTHONPATH=src python benchmarks/learn_loop_smollm2.py --rounds 3 --questions 24 --epochs 3
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _receipt  # noqa: E402

QUESTION = "What is {a} + {b}? Reply with the number only."


def ask(base_url: str, model: str, questions: list[tuple[int, int]]) -> list[tuple[str, str]]:
    """(completion id, answer) for each question, through /v1 as any app would ask."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="tml-dummy")

    def one(q):
        reply = client.chat.completions.create(
            model=model, max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": QUESTION.format(a=q[0], b=q[1])}],
        )  # fmt: skip
        return reply.id, reply.choices[0].message.content or ""

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, questions))


def judged(questions, replies, rng: random.Random, shuffled: bool) -> list[dict]:
    """The scripted judge: score 1 for the right sum, else 0 and the sum as a correction
    (with ``shuffled``, a wrong sum)."""
    rows = []
    for (a, b), (trace_id, answer) in zip(questions, replies, strict=True):
        right = str(a + b)
        target = str(a + b + rng.randint(1, 9)) if shuffled else right
        good = answer.strip().rstrip(".") == right and not shuffled
        rows.append({
            "messages": [{"role": "user", "content": QUESTION.format(a=a, b=b)},
                         {"role": "assistant", "content": answer}],
            "feedback": [{"key": "correct", "score": 1 if good else 0, "value": None,
                          "comment": None, "correction": None if good else target,
                          "source": "scripted-judge"}],
            "origin": {"format": "capture", "trace_id": trace_id, "call_id": ""},
        })  # fmt: skip
    return rows


def _answers(folder: Path) -> dict:
    """What each side answered on the held-out questions (the scores say only right/wrong)."""
    evaluated = json.loads((folder / "evaluated.json").read_text()).get("held_out") or {}
    return {
        side: evaluated[side]["answers"] for side in ("current", "candidate") if side in evaluated
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--model", help="SmolLM2 folder already converted (default: the GGUF)")
    args = parser.parse_args()
    _receipt.exit_on_sigterm()

    import os

    from rlcli.client import aliases
    from rlcli.demo.run import smollm2_gguf
    from rlcli.learn import gate
    from rlcli.learn.folder import PLAN, learn_dir, rounds
    from rlcli.learn.round import LearnOptions, run_round
    from rlcli.models.gguf import import_gguf

    tmp = Path(tempfile.mkdtemp(prefix="learn-loop-"))
    os.environ["RLCLI_HOME"] = str(tmp / "home")
    model = Path(args.model) if args.model else import_gguf(smollm2_gguf(), tmp / "smollm2")
    rng = random.Random(0)
    result = {"benchmark": "learn_loop_smollm2", "machine": _receipt.machine(),
              "settings": vars(args), "rounds": []}  # fmt: skip
    with _receipt.local_server(model, tmp, dtype="float32") as server:
        url = server.base_url
        aliases.set_alias(url, "qa", str(model), why="the base model")
        traces_dir = tmp / "traces"
        traces_dir.mkdir()
        plan = [False] * args.rounds + [True]  # the last round: shuffled verdicts
        for number, shuffled in enumerate(plan, start=1):
            questions = [(rng.randint(10, 49), rng.randint(10, 49)) for _ in range(args.questions)]
            asked = time.time()
            replies = ask(url, "qa", questions)
            rows = judged(questions, replies, rng, shuffled)
            path = traces_dir / f"round{number}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            served_right = sum(r["feedback"][0]["score"] for r in rows) / len(rows)
            opts = LearnOptions(
                alias="qa", traces=[str(traces_dir)], base_url=url, epochs=args.epochs,
                lr=args.lr, max_tokens=12, margin=1.0,
            )  # fmt: skip
            receipt = run_round(opts, lambda line: print(line, file=sys.stderr, flush=True))
            held = receipt["scores"].get("held_out", {})
            result["rounds"].append({
                "round": number, "shuffled_verdicts": shuffled, "decision": receipt["decision"],
                "why": receipt["why"], "served_right_while_asked": served_right,
                "held_out_current": held.get("current"),
                "held_out_candidate": held.get("candidate"),
                "regression": receipt["scores"].get("regression"), "seconds": receipt["seconds"],
                "capture_to_decision_s": round(time.time() - asked, 1),
                "traces": receipt["traces"],
                "held_out_answers": _answers(learn_dir("qa") / f"{number:03d}"),
            })  # fmt: skip
            _receipt.write("learn_loop_smollm2", result)
        pool = []
        for folder in rounds("qa"):
            pool += [t for t in json.loads((folder / PLAN).read_text())["held_out"] if t["target"]]
        prompts, targets = [t["prompt"] for t in pool], [t["target"] for t in pool]
        served = aliases.resolve(url, "qa")["checkpoint"]
        before = gate.score_all(gate.answers(url, str(model), prompts, 12), targets, None, [])
        after = gate.score_all(gate.answers(url, served, prompts, 12), targets, None, [])
        result["held_out_all"] = {
            "questions": len(pool), "base": before.summary(), "served_after": after.summary(),
            "gain_points": round(100 * (after.mean - before.mean), 1), "target_points": 20,
        }  # fmt: skip
        result["plot"] = str(learn_dir("qa") / "scores.png")
    print(json.dumps(result["held_out_all"], indent=2))
    print(_receipt.write("learn_loop_smollm2", result))


if __name__ == "__main__":
    main()

"""Scoring a candidate against the served adapter, and the promotion gate.

Both policies answer the same held-out and regression prompts greedily through ``/v1`` (so
the comparison is side by side, row by row); an answer scores 1 when it matches the right
answer the feedback gave (``match``: case, spacing and end punctuation aside), or what a user
reward function returns. The gate promotes only when the candidate's held-out mean beats the
current one by ``margin`` and the regression set drops by no more than ``max_regression``
(points, 0-100).
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlcli.errors import RlcliError

_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    return _SPACE.sub(" ", text).strip().strip(string.punctuation + " ").lower()


def match(answer: str, target: str) -> float:
    return float(normalize(answer) == normalize(target))


def answers(
    base_url: str, model: str, prompts: list[list[dict]], max_tokens: int, workers: int = 8
) -> list[str]:
    """Greedy answers of ``model`` (a checkpoint or the base model) through ``/v1``, sent
    together so the server batches them."""
    import openai

    from rlcli.client import endpoint

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=endpoint.api_key(), max_retries=2)

    def one(messages: list[dict]) -> str:
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, seed=0
        )
        return reply.choices[0].message.content or ""

    try:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, prompts))
    except openai.APIError as e:
        raise RlcliError(f"sampling {model} at {base_url}/v1 failed: {e}") from None


@dataclass
class Scores:
    values: list[float]

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else 0.0

    def interval(self) -> list[float]:
        """A 95% interval of the mean (normal approximation), in the scores' own units."""
        half = 1.96 * _sd(self.values) / math.sqrt(len(self.values)) if self.values else 0.0
        return [round(self.mean - half, 4), round(self.mean + half, 4)]

    def summary(self) -> dict:
        return {"n": len(self.values), "mean": round(self.mean, 4), "ci95": self.interval()}


def paired(current: Scores, candidate: Scores) -> dict:
    """The candidate minus the current, row by row, with its 95% interval."""
    diffs = Scores([b - a for a, b in zip(current.values, candidate.values, strict=True)])
    return diffs.summary()


def _sd(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def score_all(
    answers_: list[str], targets: list[str], reward: Callable | None, questions: list[str]
) -> Scores:
    """``match`` per answer, or ``reward(question, answer, target)``."""
    if reward is None:
        return Scores([match(a, t) for a, t in zip(answers_, targets, strict=True)])
    rows = zip(questions, answers_, targets, strict=True)
    return Scores([float(reward(q, a, t)) for q, a, t in rows])


def decide(held_out: dict, regression: dict | None, margin: float, max_regression: float):
    """(promote?, one line why), from the two sides' summaries (means in 0..1)."""
    gain = 100 * (held_out["candidate"]["mean"] - held_out["current"]["mean"])
    line = f"held-out {100 * held_out['current']['mean']:.1f} -> "
    line += f"{100 * held_out['candidate']['mean']:.1f} ({gain:+.1f} points"
    if gain < margin:
        return False, line + f", below the --margin of {margin:g})"
    if regression is not None:
        drop = 100 * (regression["current"]["mean"] - regression["candidate"]["mean"])
        if drop > max_regression:
            return False, line + (
                f"), but the regression set drops {drop:.1f} points (--max-regression "
                f"{max_regression:g})"
            )
        line += f"; regression {-drop:+.1f}"
    return True, line + ")"

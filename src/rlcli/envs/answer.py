"""Grading a free-text answer against a reference: the cookbook ``ProblemEnv`` behind a user's
JSONL environment and niah.

A reference that is a number is matched numerically: the response's last ``\\boxed{}`` value if
it has one, else the last number in it (commas dropped: "1,000" is 1000). Any other reference is
matched exactly after normalising both sides (case, surrounding whitespace and punctuation,
inner runs of whitespace; the boxed value if there is one). The reward is the cookbook's:
1 for a correct answer, minus its format penalty (0.1) when the response did not end with the
renderer's stop sequence, as for the cookbook's own environments.
"""

from __future__ import annotations

import re
import string

from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.math_grading import extract_boxed
from tinker_cookbook.rl.problem_env import ProblemEnv

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_EDGES = string.whitespace + string.punctuation.replace("%", "").replace("$", "")


def as_number(text: str) -> float | None:
    """``text`` as a number if it is exactly one ("42", "-3.5", "1,000", " 7. "), else None."""
    cleaned = text.strip().rstrip(".").replace(",", "")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", cleaned):
        return None
    return float(cleaned)


def normalize(text: str) -> str:
    return " ".join(text.strip(_EDGES).lower().split())


def boxed(text: str) -> str | None:
    try:
        return extract_boxed(text)
    except ValueError:
        return None


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def is_correct(response: str, reference: str) -> bool:
    """Numeric match when ``reference`` is a number, else normalised exact match."""
    target = as_number(reference)
    inner = boxed(response)
    if target is not None:
        value = as_number(inner) if inner is not None else last_number(response)
        return value is not None and abs(value - target) <= 1e-9 * max(1.0, abs(target))
    return normalize(inner if inner is not None else response) == normalize(reference)


class AnswerEnv(ProblemEnv):
    """One question, one reference answer."""

    def __init__(
        self,
        question: str,
        answer: str,
        renderer: renderers.Renderer,
        convo_prefix: list[renderers.Message] | None = None,
    ) -> None:
        super().__init__(renderer, convo_prefix)
        self.question, self.answer = question, answer

    def get_question(self) -> str:
        return self.question

    def check_answer(self, sample_str: str) -> bool:
        return is_correct(sample_str, self.answer)

    def check_format(self, sample_str: str) -> bool:
        return True  # only the stop sequence counts, as for the cookbook's arithmetic

    def get_reference_answer(self) -> str:
        return self.answer

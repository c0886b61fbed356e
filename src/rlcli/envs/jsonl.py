"""A user's own problems: a JSONL file of ``{"question": str, "answer": str | number}`` (an
optional ``"id"``), graded by numeric match when the answer is a number and by normalised exact
match otherwise (``answer.py``). Every bad line is reported by number when the environment is
made, before any server work. A file is one split: ``train rl`` trains on it and ``eval rl``
scores it (hold out your own file for evaluation).

With a reward function of the user's (``train rl --reward``, ``reward_fn.py``) a row needs only
its ``"question"``; every other field is the function's, and it grades the answers instead."""

from __future__ import annotations

import math
from pathlib import Path

from rlcli.data.chat import read_jsonl
from rlcli.envs.base import Environment
from rlcli.envs.reward_fn import scorer
from rlcli.errors import RlcliError


def _text(number: int | float) -> str:
    """A JSON number as the plain text grading reads ("1000", "0.00001", never "1e-05")."""
    if isinstance(number, int) or number.is_integer():
        return str(int(number))
    text = repr(number)
    return f"{number:.15f}".rstrip("0").rstrip(".") if "e" in text else text


def to_problem(row) -> tuple[dict | None, str | None]:
    """(row, None) for a usable parsed line, else (None, why not)."""
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        keys = ", ".join(sorted(row)) or "none"
        return None, f'"question" is not a non-empty string (keys: {keys})'
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return None, '"answer" is not a string or a number'
    if isinstance(answer, str) and not answer.strip():
        return None, '"answer" is empty'
    if isinstance(answer, float) and not math.isfinite(answer):
        return None, '"answer" is not a finite number'
    out = {"question": question, "answer": answer if isinstance(answer, str) else _text(answer)}
    if "id" in row:
        if isinstance(row["id"], bool) or not isinstance(row["id"], str | int):
            return None, '"id" is not a string or an integer'
        out["id"] = str(row["id"])
    return out, None


def to_scored_problem(row) -> tuple[dict | None, str | None]:
    """A row for a ``--reward`` function: a question, and any fields it wants."""
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        keys = ", ".join(sorted(row)) or "none"
        return None, f'"question" is not a non-empty string (keys: {keys})'
    out = {"question": question, "fields": row}
    if "id" in row:
        out["id"] = str(row["id"])
    return out, None


class JsonlFile(Environment):
    name = "jsonl"

    def __init__(self, path: Path, flag: str = "--env", reward: dict | None = None) -> None:
        """``reward``: the user's function (``{"path", "name", "timeout", "errors_path"}``)
        grades the answers instead of the rows' ``"answer"``."""
        self.path, self.reward = path.expanduser().resolve(), reward
        parse, what = to_problem, '{"question", "answer"} rows'
        if reward:
            parse, what = to_scored_problem, '{"question", ...} rows'
        try:
            with self.path.open() as f:
                rows = read_jsonl(f, f"{flag} {path}", parse, what)
        except OSError as e:
            raise RlcliError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise RlcliError(f"{flag} {path}: not UTF-8 text") from None
        for i, row in enumerate(rows):
            row.setdefault("id", f"row-{i + 1}")
        self._rows = rows

    @property
    def source(self) -> str:
        return str(self.path)

    @property
    def has_test_split(self) -> bool:
        return False

    def rows(self, split: str) -> list[dict]:
        return self._rows

    def make_env(self, row: dict, renderer):
        if self.reward:
            from rlcli.envs.reward_env import RewardFnEnv  # lazy: imports the cookbook, tinker

            return RewardFnEnv(row, renderer, scorer(**self.reward))
        from rlcli.envs.answer import AnswerEnv  # lazy: imports the cookbook

        return AnswerEnv(row["question"], row["answer"], renderer)

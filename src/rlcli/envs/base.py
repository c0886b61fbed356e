"""What every environment provides, and the reproducible sequence of its problems.

A *row* is one problem as a small JSON-able dict with an ``"id"``; ``make_env(row, renderer)``
turns it into the cookbook ``ProblemEnv`` that builds the prompt and grades the answer. Rows
come from data (``rows(split)``: GSM8K's files, a user's JSONL) or are generated
(``generate(split, seed, index)``: arithmetic, niah), each from its own seeded stream so that
the same seed gives the same problems in the same order and the train and test streams differ.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


class Environment:
    name: str = ""
    generated: bool = False
    # Multi-turn (Harbor): a task is an episode run by ``episodes()``, not ``make_env``.
    multi_turn: bool = False
    # Generated environments have no natural size: one `train rl` pass is this many batches
    # (the cookbook's n_batches for arithmetic).
    train_batches: int = 100
    # Each row's prompt is a context document then a question, kept apart (niah: the haystack
    # and the question): ``context_parts``. ``eval rl --without-context``/``--hypernet`` need it.
    has_context: bool = False

    @property
    def source(self) -> str:
        """Where the problems come from (plans and results show it)."""
        return "generated"

    @property
    def has_test_split(self) -> bool:
        return True

    def rows(self, split: str) -> list[dict]:
        """Every row of ``split`` ("train" or "test"), in file order (data environments)."""
        raise NotImplementedError

    def generate(self, split: str, seed: int, index: int) -> dict:
        """Row ``index`` of the ``split`` stream for ``seed`` (generated environments)."""
        raise NotImplementedError

    def make_env(self, row: dict, renderer):
        """The cookbook ``ProblemEnv`` that prompts with ``row`` and grades the answer."""
        raise NotImplementedError

    def context_parts(self, row: dict) -> tuple[str, str]:
        """(the context document, the question without it) of a row (``has_context``)."""
        raise NotImplementedError

    def count(self, split: str) -> int | None:
        """Rows in ``split``; None for a generated environment (as many as asked for)."""
        return None if self.generated else len(self.rows(split))

    def problems(
        self, split: str, seed: int, count: int | None = None, *, shuffle: bool = True
    ) -> Problems:
        """The first ``count`` problems of ``split`` for ``seed``: a data split shuffled by the
        seed (``shuffle=False``: file order), a generated one drawn from the seed's stream."""
        if self.generated:
            if count is None:
                raise ValueError("a generated environment needs a count")
            return Problems(self, split, seed, count, None)
        rows = self.rows(split)
        order = list(range(len(rows)))
        if shuffle:
            random.Random(seed).shuffle(order)  # same permutation as shuffling the rows
        if count is not None:
            order = order[:count]
        return Problems(self, split, seed, len(order), [rows[i] for i in order])


class Problems(Sequence):
    """A split's problems in a fixed order; generated rows are made when first read (a niah
    pass of thousands of long contexts is never held in memory at once)."""

    def __init__(self, env: Environment, split: str, seed: int, size: int, rows) -> None:
        self.env, self.split, self.seed, self.size, self._rows = env, split, seed, size, rows

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if not -self.size <= index < self.size:
            raise IndexError(index)
        index %= self.size
        if self._rows is not None:
            return self._rows[index]
        return self.env.generate(self.split, self.seed, index)


def stream(name: str, split: str, seed: int, index: int) -> random.Random:
    """The generator of one generated row: its own seed from (environment, split, seed, index),
    so rows are independent of how many were drawn before and the splits never share one."""
    return random.Random(f"{name}/{split}/{seed}/{index}")  # str seeds hash with SHA-512

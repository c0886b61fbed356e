"""Needle in a haystack: a generated filler text with one fact in it ("The magic number of
Ada is 4821."), and a question asking for the number, graded numerically (``answer.py``).

Settings (``niah:words=500,depth=0.5``): ``words``, the filler's length in words (default 500:
about 1,700 tokens with the tiny test model's tokenizer, well inside its 4,096 positions, and
a few hundred with a real model's); ``depth``, where the fact sits, from 0 (the start) to 1 (the
end), default a random depth per problem. Everything else (the filler, the name, the number)
comes from the row's seeded stream.

A row's ``question`` is the haystack, a blank line, then the question; ``context`` (the
haystack, needle included) and ``query`` (the question alone) are kept apart too, so ``eval
rl`` can ask the question without the haystack (``--without-context``, ``--hypernet``) without
parsing the prompt.
"""

from __future__ import annotations

from rlcli.envs.base import Environment, stream
from rlcli.errors import RlcliError

DEFAULT_WORDS = 500
MAX_WORDS = 200_000

NAMES = (
    "Ada", "Boris", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas",
    "Keiko", "Luca", "Maya", "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sven", "Tara",
)  # fmt: skip
SUBJECTS = (
    "The river", "A farmer", "The old mill", "A small boat", "The village", "A teacher",
    "The market", "A tall tree", "The bakery", "A quiet road", "The harbor", "A child",
)  # fmt: skip
VERBS = (
    "passes", "watches", "follows", "waits near", "leans toward", "looks over", "circles",
    "rests beside", "faces", "drifts past",
)  # fmt: skip
OBJECTS = (
    "the green hills", "the stone bridge", "a field of wheat", "the morning fog",
    "the busy square", "an empty barn", "the long fence", "the evening light",
    "a row of houses", "the cold lake",
)  # fmt: skip
TAILS = ("", " every day", " in the spring", " without a sound", " before noon", " as usual")


class Niah(Environment):
    name = "niah"
    generated = True
    has_context = True
    train_batches = 100

    def __init__(self, words: int = DEFAULT_WORDS, depth: float | None = None) -> None:
        self.words, self.depth = words, depth

    @classmethod
    def from_params(cls, params: dict[str, str], spec: str, flag: str) -> Niah:
        unknown = set(params) - {"words", "depth"}
        if unknown:
            raise RlcliError(
                f"{flag} {spec}: unknown setting {sorted(unknown)[0]!r} (words, depth)"
            )
        try:
            words = int(params.get("words", DEFAULT_WORDS))
            depth = float(params["depth"]) if "depth" in params else None
        except ValueError:
            raise RlcliError(f"{flag} {spec}: words is a whole number, depth a number") from None
        if not 10 <= words <= MAX_WORDS:
            raise RlcliError(f"{flag} {spec}: words must be in [10, {MAX_WORDS}]")
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise RlcliError(f"{flag} {spec}: depth must be in [0, 1]")
        return cls(words, depth)

    @property
    def source(self) -> str:
        where = "a random depth" if self.depth is None else f"depth {self.depth:g}"
        return f"generated ({self.words} words, {where})"

    def generate(self, split: str, seed: int, index: int) -> dict:
        rng = stream(self.name, split, seed, index)
        name, number = rng.choice(NAMES), rng.randint(1000, 9999)
        depth = rng.random() if self.depth is None else self.depth
        sentences, count = [], 0
        while count < self.words:
            sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
            sentences.append(sentence + rng.choice(TAILS) + ".")
            count += len(sentences[-1].split())
        needle = f"The magic number of {name} is {number}."
        sentences.insert(round(depth * len(sentences)), needle)
        haystack = " ".join(sentences)
        query = f"What is the magic number of {name}? Answer with the number only."
        return {
            "id": f"{split}-{seed}-{index}",
            "question": f"{haystack}\n\n{query}",
            "answer": str(number),
            "depth": round(depth, 4),
            "context": haystack,
            "query": query,
        }

    def context_parts(self, row: dict) -> tuple[str, str]:
        return row["context"], row["query"]

    def make_env(self, row: dict, renderer):
        from rlcli.envs.answer import AnswerEnv  # lazy: imports the cookbook

        return AnswerEnv(row["question"], row["answer"], renderer)

"""Doc-to-LoRA training data: documents with questions and answers, read or generated.

A line of ``rlcli train d2l --dataset`` is ``{"document": ..., "question": ..., "answer": ...}``
or ``{"document": ..., "qa": [{"question": ..., "answer": ...}, ...]}``; each question becomes
one example (the document internalized, the question asked, the answer scored). A line with a
document only gets its questions as ``rlcli internalize`` writes them (``probes.template_probes``,
up to ``TEMPLATED_PER_DOCUMENT``: each sentence that names something, asked about, its own
text or its last name or number the answer). Every bad line is named by number before anything
runs.

``synthetic_facts`` writes documents offline so a first hypernetwork needs no data: each states
one fact about a made-up person (favourite colour, pet, city, ...) with an answer from a small
closed set, optionally hidden in filler sentences (a needle in a haystack). Made-up names make
the answer unknowable without the document, so a held-out document's answer is above chance
only if the adapter carries it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from rlcli.data.chat import read_jsonl

SYNTHETIC = "synthetic:"  # --dataset synthetic:N (N generated fact documents)
TEMPLATED_PER_DOCUMENT = 8  # questions written for a line that gives a document only

# (statement, question, the answers it draws from)
FACTS = [
    ("{name}'s favorite color is {answer}.", "What is {name}'s favorite color?",
     ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")),
    ("{name} has a pet {answer}.", "What kind of pet does {name} have?",
     ("cat", "dog", "horse", "rabbit", "parrot", "snake", "turtle", "fish")),
    ("{name} lives in {answer}.", "In which city does {name} live?",
     ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima")),
    ("{name} plays the {answer}.", "Which instrument does {name} play?",
     ("piano", "guitar", "violin", "drums", "flute", "cello", "trumpet", "harp")),
]  # fmt: skip
SYLLABLES = ("ka", "lo", "mi", "ren", "zu", "tor", "vel", "sha", "nim", "dra", "qui", "bex")
FILLER = (
    "The weather was mild that week.", "A train left the station at noon.",
    "The library closes early on Sundays.", "Several birds sat on the fence.",
    "The market sold bread and cheese.", "A river runs through the valley.",
    "The meeting was moved to Thursday.", "Lights were on in the old house.",
)  # fmt: skip


def _example(row) -> tuple[list[dict] | None, str | None]:
    if not isinstance(row, dict):
        return None, "not a JSON object"
    doc = row.get("document")
    if not isinstance(doc, str) or not doc.strip():
        return None, '"document": missing or empty (a non-empty string)'
    pairs = row.get("qa")
    if pairs is None and row.get("question") is None and row.get("answer") is None:
        from rlcli.data.probes import template_probes

        pairs = template_probes(doc, TEMPLATED_PER_DOCUMENT)
        if not pairs:
            return None, (
                "a document only, and no sentence in it names something (a capitalised name "
                'or a number) to write a question about: give "question" and "answer"'
            )
    if pairs is None:
        pairs = [{"question": row.get("question"), "answer": row.get("answer")}]
    if not isinstance(pairs, list) or not pairs:
        return None, '"qa": a non-empty list of {"question", "answer"}'
    out = []
    for i, pair in enumerate(pairs):
        where = '"qa"' + f"[{i}]" if "qa" in row else "the row"
        if not isinstance(pair, dict):
            return None, f"{where}: not an object"
        for key in ("question", "answer"):
            value = pair.get(key)
            if not isinstance(value, str) or not value.strip():
                return None, f'{where}: "{key}" missing or empty (a non-empty string)'
        out.append({"document": doc, "question": pair["question"], "answer": pair["answer"]})
    return out, None


def read_examples(lines: Iterable[str], source: str) -> list[dict]:
    """Every line's examples, flattened; ``DataError`` naming each bad line."""
    rows = read_jsonl(lines, source, _example, "documents with questions")
    return [example for row in rows for example in row]


def made_up_name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def synthetic_facts(n: int, seed: int = 0, filler: int = 0) -> list[dict]:
    """``n`` documents of one fact each (``filler`` sentences of haystack around it), as
    dataset rows ``{"document", "question", "answer"}``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        statement, question, answers = rng.choice(FACTS)
        name, answer = made_up_name(rng), rng.choice(answers)
        sentences = [rng.choice(FILLER) for _ in range(filler)]
        sentences.insert(rng.randint(0, filler), statement.format(name=name, answer=answer))
        rows.append({
            "document": " ".join(sentences),
            "question": question.format(name=name),
            "answer": answer,
        })  # fmt: skip
    return rows


def synthetic_haystacks(n: int, seed: int = 0, most: int = 0, ramp: float = 0.0) -> list[dict]:
    """``n`` one-fact documents, each hiding its fact among 0..``most`` filler sentences drawn
    per document (0: ``synthetic_facts``' bare facts). Varied lengths are what taught
    SmolLM2's hypernetwork to find the fact (docs/d2l.md, "Measured"). ``ramp``: the most
    grows linearly from 0 over the first ``ramp`` of the documents (a curriculum, in order)."""
    if not most:
        return synthetic_facts(n, seed=seed)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        at_most = round(most * min(1.0, i / (ramp * n))) if ramp else most
        seeded = rng.getrandbits(32)
        rows.append(synthetic_facts(1, seed=seeded, filler=rng.randint(0, at_most))[0])
    return rows


def split_count(rng: random.Random, most: int) -> int:
    """How many pieces training reads a document as (the server's ``split_ids``): one half
    the time, else 2..``most`` evenly, after the reference's ``num_chunk_probs`` (one: 0.5,
    two: 0.125, three to eight: 0.0625 each)."""
    return 1 if most < 2 or rng.random() < 0.5 else rng.randint(2, most)


def answer_choices(question: str) -> tuple[str, ...] | None:
    """The closed set a synthetic question's answer comes from (None: not one of ours)."""
    for _, template, answers in FACTS:
        prefix = template.split("{name}")[0]
        if question.startswith(prefix):
            return answers
    return None

"""Probes for ``rlcli internalize``: the questions the teacher answers with the document in
view, and the student learns to answer without it.

Two sources. ``--questions FILE``: JSONL rows ``{"question": ..., "answer": ...}`` (the answer
optional; ``"document"`` may name the document a row is about, by path or 0-based index;
``"held_out": true`` keeps a row for the receipt only). ``--n-questions N``: questions written
from the document, by the teacher model (``WRITE_QUESTIONS``, its reply read by
``written_questions``; no reference answer) or, for small models that cannot write good ones,
by templates (``template_probes``): each sentence that names something (a capitalised name or
a number) is asked about in several wordings, its own text the reference answer, and cloze
forms whose answer is the sentence's last name or number (``check``, what the receipt looks
for in an answer).

``split`` then keeps a ``--test-size`` share of each document's probes out of training.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable

from rlcli.data.chat import read_jsonl
from rlcli.data.documents import best_chunk, sentences

# A name: capitalised words (a lower-case joiner such as "de" or "of" allowed between them).
_NAME = r"[A-Z][\w'-]*(?:\s+(?:(?:de|da|van|von|of|the|del|la|le)\s+)?[A-Z][\w'-]*)*"
_SUBJECT = re.compile(rf"^(?:The\s+|A\s+|An\s+)?({_NAME})")
_KEY = re.compile(rf"(\d[\d,.:/-]*\d|\d|{_NAME})\s*[.!?]?\s*[\"')\]]?$")
_STARTERS = {"The", "A", "An", "It", "This", "That", "These", "Those", "There", "In", "On", "At"}

# (question, answer kind): answer "sentence" is the whole sentence, "key" its last name/number.
SUBJECT_TEMPLATES = (
    ("What does the document say about {subject}?", "sentence"),
    ("What do you know about {subject}?", "sentence"),
    ("Tell me the fact about {subject}.", "sentence"),
    ("Complete this sentence: {prefix} ...", "key"),
    ("Fill in the blank: {prefix} ___.", "key"),
    ("Repeat what you read about {subject}.", "sentence"),
)
PLAIN_TEMPLATES = (("Continue this sentence from the document: {half} ...", "rest"),)
# What the teacher is asked, after a chunk, to write questions about it.
WRITE_QUESTIONS = (
    "Write {n} different questions that the text above answers, one per line. "
    "Write only the questions."
)
# "1.", "2)", "-", "Q3:", "Question 4:", "A: 1." (as many as lead the line)
_NUMBERING = re.compile(
    r"^\s*(?:(?:[-*\u2022]|\(?(?:\d+|[a-z])[.):]|q(?:uestion)?\s*\d*\s*[.):])\s*)*", re.I
)


def to_question(row) -> tuple[dict | None, str | None]:
    """A ``--questions`` row as a probe, or (None, why not)."""
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        keys = ", ".join(sorted(row)) or "none"
        return None, f'"question" is missing or not a non-empty string (keys: {keys})'
    answer = row.get("answer")
    if answer is not None and (not isinstance(answer, str) or not answer.strip()):
        return None, '"answer" is not a non-empty string'
    document = row.get("document")
    if document is not None and (isinstance(document, bool) or not isinstance(document, str | int)):
        return None, '"document" is not a path or an index'
    held_out = row.get("held_out", False)
    if not isinstance(held_out, bool):
        return None, '"held_out" is not true or false'
    return {
        "question": question.strip(),
        "answer": answer.strip() if answer else None,
        "document": document,
        "held_out": held_out,
        "source": "questions",
    }, None


def read_questions(lines: Iterable[str], source: str) -> list[dict]:
    """Parse ``--questions`` JSONL; ``DataError`` lists every bad line."""
    return read_jsonl(lines, source, to_question, "questions")


def key_of(sentence: str) -> tuple[str, str] | None:
    """(the sentence before its last name or number, that name or number), or None."""
    match = _KEY.search(sentence.rstrip())
    if not match or match.start(1) == 0:
        return None
    prefix = sentence[: match.start(1)].rstrip(" ,;:")
    if len(prefix.split()) < 2:
        return None
    return prefix, match.group(1).rstrip(".,")


def subject_of(sentence: str) -> str | None:
    match = _SUBJECT.match(sentence)
    if not match:
        return None
    subject = match.group(1)
    if subject in _STARTERS or subject.split()[0] in _STARTERS and len(subject.split()) == 1:
        return None
    return subject


def sentence_probes(sentence: str) -> list[dict]:
    """Every templated probe of one sentence (fact-like sentences first in the caller)."""
    subject, keyed = subject_of(sentence), key_of(sentence)
    out = []
    if subject and keyed:
        prefix, key = keyed
        for template, kind in SUBJECT_TEMPLATES:
            question = template.format(subject=subject, prefix=prefix)
            answer = sentence if kind == "sentence" else key
            out.append({"question": question, "answer": answer, "check": key})
        return out
    words = sentence.split()
    if len(words) >= 6:
        half = " ".join(words[: len(words) // 2])
        rest = " ".join(words[len(words) // 2 :])
        for template, _ in PLAIN_TEMPLATES:
            out.append({"question": template.format(half=half), "answer": rest, "check": rest})
    return out


def template_probes(text: str, n: int) -> list[dict]:
    """Up to ``n`` templated probes of a document: the sentences that name something first,
    then the others; wording by wording across sentences (every sentence's first wording,
    then every second one...), so a cap below the total still asks about every sentence."""
    facts, others = [], []
    for sentence in sentences(text):
        probes = sentence_probes(sentence)
        if probes and subject_of(sentence) and key_of(sentence):
            facts.append(probes)
        elif probes:
            others.append(probes)
    ordered = [p for groups in (facts, others) for p in _wording_by_wording(groups)]
    return [{**p, "source": "template", "held_out": False} for p in ordered[:n]]


def templated(index: int, text: str, chunks: list[str], n: int) -> list[dict]:
    """Document ``index``'s ``template_probes``, each with the chunk its sentence is in."""
    rows = []
    for probe in template_probes(text, n):
        sentence = probe["answer"] if probe["answer"] in text else probe["question"]
        chunk = next(
            (j for j, piece in enumerate(chunks) if sentence in piece),
            best_chunk(chunks, sentence),
        )
        rows.append({**probe, "document": index, "chunk": chunk})
    return rows


def _wording_by_wording(groups: list[list[dict]]) -> list[dict]:
    most = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(most) for g in groups if i < len(g)]


def question_key(question: str) -> str:
    """What makes two written questions the same one: case and spacing aside."""
    return " ".join(question.lower().split())


def written_questions(reply: str, n: int) -> list[str]:
    """The questions in a model's reply to ``WRITE_QUESTIONS``: its lines that end in "?"
    (numbering and bullets stripped), of 3 to 40 words, each once, at most ``n``."""
    out, seen = [], set()
    for line in reply.splitlines():
        question = _NUMBERING.sub("", line).strip()
        key = question_key(question)
        if question.endswith("?") and 3 <= len(question.split()) <= 40 and key not in seen:
            seen.add(key)
            out.append(question)
    return out[:n]


def held_count(n: int, test_size: float) -> int:
    """How many of ``n`` probes ``split`` holds out: ``ceil(test_size * n)``, leaving one."""
    return min(math.ceil(test_size * n), max(n - 1, 0)) if test_size else 0


def split(probes: list[dict], test_size: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(training probes, held-out probes): rows marked ``held_out`` plus ``ceil(test_size *
    n)`` of the others, drawn with ``seed``; at least one probe is always trained on."""
    forced = [p for p in probes if p.get("held_out")]
    free = [p for p in probes if not p.get("held_out")]
    order = list(range(len(free)))
    random.Random(seed).shuffle(order)
    chosen = set(order[: held_count(len(free), test_size)])
    train = [p for i, p in enumerate(free) if i not in chosen]
    held = forced + [p for i, p in enumerate(free) if i in chosen]
    return train, [{**p, "held_out": True} for p in held]

"""Judged traces -> what one learning round uses: the prompt, the served answer, the verdict,
and the answer a right reply should give (a correction, or the answer itself when judged good).

Rows are what ``rlcli import -f langsmith|langfuse|otel`` and ``traces export --as judged``
write, or a capture folder itself (``serve start --capture``): ``messages`` ending in the
judged assistant turn, ``feedback`` entries with LangSmith's names, ``origin`` naming the
trace. A row's id is its origin's trace and call ids (or its ``id``), so the held-out split
(a hash of the id) is the same in every round. Rows without a verdict are not judged and
wait; a row that is not a conversation ending in an answer is counted, not used.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rlcli import trace_format
from rlcli.errors import RlcliError
from rlcli.files.jsonl import read_jsonl

GOOD = 0.5  # a numeric verdict at or above this marks the answer good (scores are 0..1)


@dataclass
class Trace:
    id: str
    prompt: list[dict]  # the messages before the judged answer
    answer: str  # what the served model answered
    target: str | None  # a right answer: the correction, or the answer when judged good
    good: bool | None  # the verdict; None: a correction without a score
    score: float | None = None
    source: str = ""


def split(traces: list[Trace], share: float) -> tuple[list[Trace], list[Trace]]:
    """(train, held out): the ``round(share * n)`` traces whose ids hash lowest are held out
    (at least one where ``share`` > 0 and there are two or more). A fixed count, where a coin
    per trace once held out none of 24 at 0.25; the same traces always split the same way."""
    n = len(traces)
    count = min(n - 1, max(1, round(share * n))) if share > 0 and n >= 2 else 0
    ranked = sorted(traces, key=lambda t: hashlib.sha256(t.id.encode()).hexdigest())
    held = {t.id for t in ranked[:count]}
    return [t for t in traces if t.id not in held], [t for t in traces if t.id in held]


@dataclass
class Found:
    traces: list[Trace] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)


def read_traces(paths: list[str]) -> Found:
    """Every judged trace in ``paths`` (JSONL files or folders of them), first one per id."""
    found, seen = Found(), set()
    for where, rows in _sources(paths):
        for number, row in enumerate(rows, start=1):
            trace, why = _trace(row, f"{where}:{number}")
            if trace is None:
                found.skipped[why] += 1
            elif trace.id not in seen:
                seen.add(trace.id)
                found.traces.append(trace)
    return found


def _sources(paths: list[str]) -> Iterator[tuple[str, list[dict]]]:
    """(where, rows) for each file of import rows; a capture folder (``serve start
    --capture``) as ``traces export --as judged`` gives it, its verdicts joined to its traces."""
    for given in paths:
        path = Path(given).expanduser()
        if path.is_dir() and trace_format.files(path, trace_format.TRACES):
            from rlcli.traces import catalog, export

            rows, _ = export.rows(catalog.load(path), "judged")
            yield str(path), rows
        elif path.is_dir():
            for file in sorted(p for p in path.rglob("*.jsonl") if p.is_file()):
                yield str(file), read_jsonl(file)[0]  # whole lines only: it may be growing
        elif path.is_file():
            yield str(path), read_jsonl(path)[0]
        else:
            raise RlcliError(f"--traces {given}: no such file or folder")


def _trace(row, where: str) -> tuple[Trace | None, str]:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        return None, "not a conversation (no messages)"
    messages = row["messages"]
    if (
        not messages
        or not isinstance(messages[-1], dict)
        or messages[-1].get("role") != "assistant"
    ):
        return None, "does not end in an assistant answer"
    feedback = [f for f in row.get("feedback") or [] if isinstance(f, dict)]
    scores = [_number(f.get("score")) for f in feedback]
    scores = [s for s in scores if s is not None]
    corrections = [c for c in (_text(f.get("correction")) for f in feedback) if c]
    if not scores and not corrections:
        return None, "no verdict yet"
    answer = str(messages[-1].get("content") or "")
    score = sum(scores) / len(scores) if scores else None
    good = None if score is None else score >= GOOD
    target = corrections[-1] if corrections else (answer if good else None)
    return Trace(_id(row), messages[:-1], answer, target, good, score, where), ""


def _id(row: dict) -> str:
    origin = row.get("origin") or {}
    if origin.get("trace_id"):
        return f"{origin['trace_id']}:{origin.get('call_id') or ''}"
    if row.get("id"):
        return str(row["id"])
    return hashlib.sha256(json.dumps(row["messages"], sort_keys=True).encode()).hexdigest()[:24]


def _number(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def _text(correction) -> str | None:
    """A correction's text: a string, a message, or LangSmith's ``{"outputs": {...}}``."""
    if isinstance(correction, str):
        return correction.strip() or None
    if isinstance(correction, dict):
        for key in ("content", "output", "answer", "text"):
            if isinstance(correction.get(key), str):
                return correction[key].strip() or None
        for key in ("outputs", "message"):
            if isinstance(correction.get(key), dict):
                return _text(correction[key])
        if isinstance(correction.get("messages"), list) and correction["messages"]:
            return _text(correction["messages"][-1])
    return None

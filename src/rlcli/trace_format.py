"""The capture folder's format, shared by the server that writes it (``serve start --capture``,
``server/state/capture.py``) and the commands that read it (``rlcli traces``, ``rlcli learn``),
as ``checkpoint_format.py`` is for checkpoints. docs/traces.md describes every field.

A capture folder holds ``traces-<UTC start>-<pid>-<seq>.jsonl`` (one exchange per line) and
``feedback-<UTC start>-<pid>-<seq>.jsonl`` (one verdict per line). A server never appends to a
file it did not open itself: each boot and each rotation starts a new file, so a line torn by a
kill stays the last line of its file and readers skip it (``files/jsonl.py``'s rule).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from rlcli.files.jsonl import read_jsonl

VERSION = 1  # "v" on every line; a change that breaks readers bumps it
TRACES, FEEDBACK = "traces", "feedback"
TRACE_ID_HEADER = "x-rlcli-trace-id"
# POST /v1/feedback: LangSmith's field names and these caps.
FEEDBACK_FIELDS = ("run_id", "key", "score", "value", "comment", "correction", "source")
MAX_KEY = 256
MAX_COMMENT = 10_000  # characters, for comment and correction each
MAX_VALUE = 10_000  # characters of value's JSON


def file_name(kind: str, started: float, pid: int, seq: int) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
    return f"{kind}-{stamp}-{pid}-{seq:04d}.jsonl"


def files(folder: Path, kind: str) -> list[Path]:
    """The files of one kind, oldest first (names start with their UTC start time)."""
    return sorted(Path(folder).glob(f"{kind}-*.jsonl"))


def read(folder: Path, kind: str) -> Iterator[dict]:
    """Every whole line of every file of one kind, oldest first."""
    for path in files(folder, kind):
        rows, _ = read_jsonl(path)
        yield from rows

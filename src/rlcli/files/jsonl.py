"""JSONL files rlcli and the cookbook append to (``metrics.jsonl``, ``checkpoints.jsonl``,
``rlcli_status.jsonl``), read by one rule:

- only whole lines count: the last one, without its newline yet, is being written (or was cut
  short by a crash) and is left for the next read;
- a torn line that a later writer appended to (a run killed mid-write, then resumed: its first
  row completes the torn one) is skipped, and said once on stderr; the rows after it stand;
- any other line that is not a JSON object is an error naming the file and the line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlcli.errors import RlcliError


def read_jsonl(path: Path, seen: int = 0) -> tuple[list[dict], int]:
    """The rows of ``path`` after its first ``seen`` lines, and the whole lines read so far
    (pass it back as ``seen`` to read only what was appended since)."""
    try:
        lines = Path(path).read_text(errors="replace").split("\n")[:-1]
    except FileNotFoundError:
        return [], seen
    rows = []
    for number, line in enumerate(lines[seen:], start=seen + 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if not _appended_after_a_tear(line):
                raise RlcliError(f"{path} line {number}: not JSON ({line[:80]!r})") from None
            _say_torn(path, number)
            continue
        if not isinstance(row, dict):
            raise RlcliError(f"{path} line {number}: not a JSON object ({line[:80]!r})")
        rows.append(row)
    return rows, max(seen, len(lines))


def _appended_after_a_tear(line: str) -> bool:
    """A cut-short row with a whole row appended to it: ``{"step": 3, "lo{"step": 3, ...}``."""
    start = line.find("{", 1)
    while start != -1:
        try:
            if isinstance(json.loads(line[start:]), dict):
                return True
        except json.JSONDecodeError:
            pass
        start = line.find("{", start + 1)
    return False


_TORN: set[tuple[str, int]] = set()


def _say_torn(path: Path, number: int) -> None:
    if (str(path), number) not in _TORN:
        _TORN.add((str(path), number))
        sys.stderr.write(f"note: {path} line {number} is torn (a write cut short); skipped\n")

"""A run folder's files: every name and format in one place.

What rlcli writes there (the cookbook adds its own: ``config.yaml`` via ``options``,
``metrics.jsonl``, ``checkpoints.jsonl``, its logs):

- ``rlcli_spec.json``: the recipe the child runs (options, plan), written before it starts;
- ``rlcli_run.json``: the run's record (running / finished / failed / interrupted / cancelled,
  pid, start and end, exit code, the one-line error), always written whole;
- ``rlcli_status.jsonl``: the child's phases, one JSON line per event;
- ``rlcli_summary.json``: the recipe's summary, written at its end;
- ``rlcli_cancel``: a ``runs cancel`` (or Ctrl-C) request, ``{"pid", "time"}``;
- ``rlcli.lock``: held (``flock``) while a command works on the folder; holds the pid;
- ``console.log``: the child's output (its ``rlcli-error:`` line names a failure);
  ``detached.log``: a ``train --detach`` run's own output.

``$RLCLI_HOME/runs/index.txt`` lists run folders outside ``$RLCLI_HOME/runs`` (``--log-path``),
one absolute path a line, guarded by ``.index.lock``. JSONL files are read by one rule
(``files/jsonl.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

from rlcli.files import atomic
from rlcli.files.jsonl import read_jsonl

SPEC = "rlcli_spec.json"
SUMMARY = "rlcli_summary.json"
CONSOLE = "console.log"
LOCK = "rlcli.lock"
RECORD = "rlcli_run.json"  # the run's state: running / finished / failed / interrupted / cancelled
CANCEL = "rlcli_cancel"  # `rlcli runs cancel` asks the recipe to stop here (holds the rlcli pid)
STATUS = "rlcli_status.jsonl"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_FILE = "checkpoints.jsonl"
DETACHED_LOG = "detached.log"
INDEX = "index.txt"  # $RLCLI_HOME/runs/index.txt: run folders elsewhere (--log-path)
ERROR_PREFIX = "rlcli-error: "  # the child's one-line error in console.log


def write_spec(run_dir: Path, spec: dict) -> None:
    (Path(run_dir) / SPEC).write_text(json.dumps(spec, indent=2) + "\n")


def append_status(run_dir: Path, phase: str, **fields) -> None:
    """One line of ``rlcli_status.jsonl`` (the parent follows it); best effort, never fails a
    run over progress."""
    line = json.dumps({"phase": phase, "time": time.time(), **fields}) + "\n"
    try:
        with (Path(run_dir) / STATUS).open("a") as f:  # one short write: never interleaved
            f.write(line)
    except OSError:
        pass


def read_json(path: Path) -> dict:
    """A JSON object file, or {} (missing, unreadable, half-written by an old rlcli)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(run_dir: Path, record: dict) -> None:
    """``rlcli_run.json``, written whole (temp file, then rename): never half a record."""
    atomic.write_text(Path(run_dir) / RECORD, json.dumps(record, indent=2) + "\n")


def read_record(run_dir: Path) -> dict | None:
    return read_json(Path(run_dir) / RECORD) or None


def request_cancel(run_dir: Path, pid: int) -> None:
    """Ask the recipe to stop at its next step boundary with a checkpoint (``rlcli_cancel``)."""
    text = json.dumps({"pid": pid, "time": time.time()})
    atomic.write_text(Path(run_dir) / CANCEL, text)


def metric_rows(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / METRICS_FILE)[0]


def checkpoint_rows(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / CHECKPOINTS_FILE)[0]


def write_metric_rows(run_dir: Path, rows: list[dict]) -> None:
    atomic.write_text(Path(run_dir) / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in rows))


def read_index(runs_root: Path) -> list[Path]:
    with contextlib.suppress(OSError):
        text = (runs_root / INDEX).read_text()
        return [Path(line.strip()) for line in text.splitlines() if line.strip()]
    return []


def add_to_index(runs_root: Path, run_dir: Path) -> None:
    """List ``run_dir`` in the index (gone folders dropped on the way)."""
    runs_root.mkdir(parents=True, exist_ok=True)
    index = runs_root / INDEX
    # The lock is a file of its own: index.txt is replaced on each write, so a lock on it
    # would be a lock on an old inode, and two runs starting at once could lose one.
    with (runs_root / ".index.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time; released on close
        paths = [str(p) for p in read_index(runs_root)]
        if str(run_dir) in paths and all(Path(p).is_dir() for p in paths):
            return
        kept = [p for p in dict.fromkeys([*paths, str(run_dir)]) if Path(p).is_dir()]
        atomic.write_text(index, "".join(p + "\n" for p in kept))


def lock_pid(run_dir: Path) -> int | None:
    """The pid the lock file names (the command that holds or last held it)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((Path(run_dir) / LOCK).read_text().split()[0])
    return None


def lock_held(run_dir: Path) -> bool:
    """Whether a command holds the run folder's lock (probed without waiting, released at
    once; never creates the file)."""
    try:
        fd = os.open(Path(run_dir) / LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the probe's lock
    return False

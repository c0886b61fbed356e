"""Capture: every ``/v1`` exchange (and, with ``--capture-tinker``, every Tinker ``asample``)
as one JSON line in the capture folder, and ``POST /v1/feedback`` verdicts beside them. The file
names and fields are ``rlcli.trace_format``'s; docs/traces.md describes them.

Why it is shaped this way:
- The request path only queues a record (``trace``): a writer thread serializes, redacts
  (``--redact``: Presidio is milliseconds a message) and appends, so the endpoint does not wait
  for the disk or the redactor.
- A line is written whole: one ``os.write`` of the whole line to a file opened ``O_APPEND``
  (looping only on a short write), then the next; a kill -9 can at worst leave the file's last
  line torn, which readers skip, and no server appends to an old file.
- Nothing queued is lost on SIGTERM: the app's shutdown (after uvicorn has finished the
  requests in flight) calls ``close``, which drains the queue before the thread ends.
- Fail-closed redaction: a record the redactor fails on is not written at all (one log line).
- A folder that cannot be written, or a nearly full disk, is one ``CaptureError`` line at
  start (``python -m rlcli.server`` exits 2 with it); a disk that fills later costs the records
  that do not fit (one log line each), never a request.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from rlcli import trace_format

log = logging.getLogger("rlcli.server")

MIN_FREE_BYTES = 64 << 20  # refuse to start capturing onto a disk with less free than this
KNOWN_IDS = 1_000_000  # trace ids remembered in memory for feedback; older ones are looked up


class CaptureError(Exception):
    """The capture folder cannot be used; one line naming it."""


class _Appender:
    """Whole lines appended to ``kind-*.jsonl``, a new file past ``max_bytes``."""

    def __init__(self, folder: Path, kind: str, max_bytes: int) -> None:
        self.folder, self.kind, self.max_bytes = folder, kind, max_bytes
        self.started, self.seq, self.fd, self.size = time.time(), 0, -1, 0
        self.path: Path | None = None
        self._open()

    def _open(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        while True:  # a name never used before (a reused pid in the same second: the next)
            self.seq += 1
            name = trace_format.file_name(self.kind, self.started, os.getpid(), self.seq)
            self.path = self.folder / name
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL
                self.fd = os.open(self.path, flags, 0o600)
                break
            except FileExistsError:
                continue
        self.size = 0

    def append(self, line: bytes) -> None:
        if self.size and self.size + len(line) > self.max_bytes:
            self._open()
        view = memoryview(line)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]
        self.size += len(line)

    def close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1


class Capture:
    def __init__(
        self, folder: str | Path, *, max_mb: float = 256.0, redact: bool = False,
        tinker: bool = False,
    ) -> None:  # fmt: skip
        self.folder = Path(folder).expanduser().resolve()
        self.tinker = tinker
        _check_folder(self.folder)
        max_bytes = max(int(max_mb * (1 << 20)), 1 << 16)
        self.traces = _Appender(self.folder, trace_format.TRACES, max_bytes)
        self.feedback_file: _Appender | None = None  # opened at the first verdict
        self.max_bytes = max_bytes
        self.redactor = _redactor() if redact else None
        self.known: dict[str, None] = {}  # recent trace ids, oldest first
        self.lock = threading.Lock()  # the feedback file (written from request threads)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.written = self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="rlcli-capture", daemon=True)
        self.thread.start()

    # ---- traces -----------------------------------------------------------------------------

    def trace(self, record: dict[str, Any]) -> None:
        """Queue one exchange (called on the event loop; never blocks on the disk)."""
        self.known[record["id"]] = None
        if len(self.known) > KNOWN_IDS:
            del self.known[next(iter(self.known))]
        self.queue.put(record)

    def _run(self) -> None:
        while True:
            record = self.queue.get()
            if record is None:
                return
            self._write(record)

    def _write(self, record: dict) -> None:
        try:
            if self.redactor is not None:
                record = _redacted(self.redactor, record)
            line = (_dumps(record) + "\n").encode()
            self.traces.append(line)
            self.written += 1
        except Exception as e:  # fail-closed: the record is not written, the server goes on
            self.dropped += 1
            self.known.pop(record.get("id"), None)
            log.error("capture: trace %s not written: %s", record.get("id"), _reason(e))

    def close(self) -> None:
        """Write everything queued, then close the files (the app's shutdown)."""
        self.queue.put(None)
        self.thread.join()
        self.traces.close()
        if self.feedback_file is not None:
            self.feedback_file.close()
        log.info("capture: %d traces written, %d not written", self.written, self.dropped)

    # ---- feedback ---------------------------------------------------------------------------

    def has_trace(self, trace_id: str) -> bool:
        """Whether ``trace_id`` was captured here (this run, or in the folder's files). Runs in
        a thread: an old id is looked for in the files."""
        if trace_id in self.known:
            return True
        needle = f'{{"v": {trace_format.VERSION}, "id": {_dumps(trace_id)},'.encode()
        for path in trace_format.files(self.folder, trace_format.TRACES):
            with path.open("rb") as f:
                if any(line.startswith(needle) for line in f):
                    return True
        return False

    def add_feedback(self, entry: dict[str, Any]) -> None:
        """Append one verdict now (called in a thread); redacted first with ``--redact``
        (fail-closed: raises, and nothing is written)."""
        if self.redactor is not None:
            entry = _redacted(self.redactor, entry)
        line = (_dumps(entry) + "\n").encode()
        with self.lock:
            if self.feedback_file is None:
                self.feedback_file = _Appender(self.folder, trace_format.FEEDBACK, self.max_bytes)
            self.feedback_file.append(line)


def _check_folder(folder: Path) -> None:
    where = f"--capture {folder}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CaptureError(f"{where}: cannot create the folder ({e.strerror})") from None
    if not folder.is_dir():
        raise CaptureError(f"{where}: not a folder")
    probe = folder / f".probe-{os.getpid()}"
    try:
        probe.write_bytes(b"x")
    except OSError as e:
        raise CaptureError(f"{where}: cannot write there ({e.strerror})") from None
    finally:
        probe.unlink(missing_ok=True)
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    if free < MIN_FREE_BYTES:
        raise CaptureError(
            f"{where}: the disk is full or nearly ({free >> 20} MiB free; capture needs at "
            f"least {MIN_FREE_BYTES >> 20} MiB)"
        )


def _redactor():
    from rlcli.data.redaction import Redactor

    try:
        return Redactor()
    except Exception as e:
        raise CaptureError(f"--redact: the redactor cannot start: {_reason(e)}") from None


# What --redact reads: the text of an exchange or a verdict, as one conversation (the same
# value gets the same placeholder in the question, the tool calls and the answer). Ids, times,
# model names and numbers are left alone. Token ids spell out the text they encode: with
# --redact they are not kept (the logprobs are).
TEXT_FIELDS = ("messages", "tools", "prompt", "choices", "value", "comment", "correction")
TOKEN_FIELDS = ("prompt_token_ids", "token_ids")


def _redacted(redactor, record: dict) -> dict:
    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in TOKEN_FIELDS}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    text = {k: strip(record[k]) for k in TEXT_FIELDS if k in record}
    redacted, report = redactor.redact_conversation(text)
    out = {k: v for k, v in record.items() if k not in TOKEN_FIELDS}
    out.update(redacted)
    out["redacted"] = report.as_dict()
    return out


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _reason(e: Exception) -> str:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return "the disk is full"
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]

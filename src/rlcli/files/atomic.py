"""Whole-or-nothing file writes: a temporary file beside the target, renamed over it, so a
reader (or a process killed mid-write) never sees half a file.

The temporary file is created like any file (mode 0666 less the umask) under a name of its own
(``.<name>.<pid>.<random>.tmp``, in the target's folder so the rename stays on one disk), and
removed if the write fails.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write; on a clean exit it replaces ``path`` (after an fsync
    with ``fsync``, for files that must survive a power cut: the server's checkpoints)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_text(path: str | os.PathLike[str], text: str, *, fsync: bool = False) -> None:
    """``path`` holds ``text`` (UTF-8), or what it held before: never a part of it."""
    with replacing(path, fsync=fsync) as tmp:
        tmp.write_text(text, encoding="utf-8")

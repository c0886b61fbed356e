"""Base model names: a hub id, a local ``save_pretrained`` folder, or a ``.gguf`` file (named
by the folder it converts to, ``$RLCLI_HOME/models/<stem>-<hash>``), so every process agrees
on one name for one model."""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path

from rlcli.home import rlcli_home


def is_local_model(name: str) -> bool:
    """A local folder holding a ``config.json`` (as ``save_pretrained`` writes it)."""
    return (Path(name).expanduser() / "config.json").is_file()


def is_gguf_file(name: str) -> bool:
    """A path to an existing file whose name ends in ``.gguf``."""
    path = Path(name).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


def resolve_model_name(name: str) -> str:
    """Absolute path for local folders (so every process agrees on it); for a ``.gguf`` file,
    the folder it converts to (without converting: see ``local_model``); hub ids unchanged."""
    if is_gguf_file(name):
        return str(gguf_folder(name))
    if is_local_model(name):
        return str(Path(name).expanduser().resolve())
    return name


@cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# Bumped whenever the conversion's output changes, so folders an older rlcli converted (for
# example before byte-level BPE tokenizers were saved under the plain class) are not reused.
GGUF_CONVERSION = 2


def gguf_folder(gguf_file: str | os.PathLike[str]) -> Path:
    """``$RLCLI_HOME/models/<file stem>-<hash of content and conversion>``: the same file gives
    the same folder wherever it lies, and a changed file (or converter) a new one."""
    source = Path(gguf_file).expanduser().resolve()
    stat = source.stat()
    content = _sha256(str(source), stat.st_size, stat.st_mtime_ns)
    digest = hashlib.sha256(f"{content}/conversion-{GGUF_CONVERSION}".encode()).hexdigest()
    return rlcli_home() / "models" / f"{source.stem}-{digest[:16]}"

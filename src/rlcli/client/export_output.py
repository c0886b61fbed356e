"""Where ``rlcli export`` writes, made safe: nothing half-written, nothing else lost.

Everything is built in a hidden folder (or file) beside ``-o`` and renamed into place at the
end (``put_in_place``); on any failure the hidden folders go and ``-o`` is as it was.
``--force`` replaces a non-empty folder only when it is a previous export (its manifest lists
every file in it), checked again just before the rename; any other folder (``-o .``, a project
folder) is refused, naming it (``check_replaceable``: invariant 13, export replaces only what it
owns). With ``--gguf``, ``--force`` replaces only a GGUF file.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from rlcli.errors import RlcliError

MANIFEST = "rlcli_export.json"  # where it came from: restore reads the tinker:// path here


def check_gguf_output(out: Path, force: bool) -> Path:
    out = Path(out).expanduser().absolute()
    if out.suffix != ".gguf":
        raise RlcliError(f"-o {out}: with --gguf, name the file to write (ending in .gguf)")
    if out.is_dir():
        raise RlcliError(f"-o {out}: is a folder; with --gguf, -o names a .gguf file")
    if out.exists():
        if not force:
            raise RlcliError(f"-o {out}: exists (pass --force to replace an earlier export)")
        with open(out, "rb") as f:
            if f.read(4) != b"GGUF":
                raise RlcliError(f"-o {out}: not a GGUF file; --force replaces only a GGUF file")
    return _writable_parent(out)


def check_output(out: Path, force: bool) -> Path:
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise RlcliError(f"-o {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise RlcliError(f"-o {out}: not empty (pass --force to replace an earlier export)")
        check_replaceable(out)
    return _writable_parent(out)


def _writable_parent(out: Path) -> Path:
    """``out``, once its parent folder exists and can take a new entry (else one line)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RlcliError(f"-o {out}: cannot create its parent folder ({e.strerror})") from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise RlcliError(f"-o {out}: {out.parent} is not writable")
    return out


def check_replaceable(out: Path) -> None:
    """``--force`` replaces only what export owns: a folder whose manifest lists every entry in
    it. Anything else (a project folder, ``-o .``, an export someone added files to) is refused
    with one line naming the folder; nothing in it is touched."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        owned = set(manifest["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        raise RlcliError(
            f"-o {out}: not empty and not an earlier export (no {MANIFEST} listing its files); "
            "--force replaces only a folder rlcli export wrote: choose a new or empty folder"
        ) from None
    foreign = sorted(p.name for p in out.iterdir() if p.name not in owned)
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise RlcliError(
            f"-o {out}: holds files rlcli export did not write ({shown}); --force replaces only "
            "an export's own files: move them or choose another folder"
        )


def put_in_place(staged: Path, out: Path) -> None:
    """Rename the finished folder to ``out``; an old ``out`` (an earlier export, checked again
    here) is moved aside first and removed only once the new one is in place."""
    umask = os.umask(0)
    os.umask(umask)
    staged.chmod(0o777 & ~umask)  # mkdtemp made it private; DIR gets the usual mode
    for path in staged.rglob("*"):  # and so do its files (safetensors writes 0600 ones)
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)
        elif path.is_dir():
            path.chmod(0o777 & ~umask)
    old = None
    if out.is_dir() and any(out.iterdir()):
        check_replaceable(out)  # again: files may have arrived during the download
        old = out.parent / f".{out.name}.old-{time.time_ns()}"
        out.rename(old)
    try:
        staged.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

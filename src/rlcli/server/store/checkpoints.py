"""Checkpoints on disk, and the ``tinker://`` paths that name them.

Invariant 3 lives here: a checkpoint name always resolves to one complete checkpoint, the old
one or the new one, never half of either and never nothing while it exists.

Layout under the checkpoints dir (one folder per training run, i.e. per training client)::

    <run_id>/run.json                       base model, LoRA config, owner session, times
    <run_id>/weights/<name>                 save_state: adapter + optimizer.pt
    <run_id>/sampler_weights/<name>         save_weights_for_sampler: adapter only

Each ``<name>`` is a symlink to a hidden version folder beside it (``.v-<name>-<ns>``) holding a
PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``, what
``peft.PeftModel.from_pretrained(base, folder)`` loads) and ``checkpoint.json`` (metadata).
A save writes and fsyncs a new version, then swaps the link with one ``rename`` (atomic), so a
reader that resolved the name reads one whole version. Superseded and interrupted versions are
swept once no link points to them and they are older than a grace period (readers of the old
version finish first); expired checkpoints (``ttl_seconds``) are swept the same way, and so are
deleted ones: ``delete`` takes the name away and leaves the version to the sweep. A version's
grace runs from the moment it lost its name (``_retire`` stamps it then), not from its save.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from rlcli import checkpoint_format
from rlcli.checkpoint_format import KINDS, CheckpointRef, TinkerPathError
from rlcli.files import atomic
from rlcli.server.errors import UserError

log = logging.getLogger("rlcli.server")

# What each kind is called in listings (``checkpoint_type``).
TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
VERSION_PREFIX = ".v-"
SWEEP_GRACE_S = 120.0  # an unreferenced version lives this long (a reader may still use it)


class CheckpointError(UserError):
    """A bad checkpoint name or path; the message says which and why."""


class CheckpointExists(CheckpointError):
    """An exclusive write found the name taken (by a save that committed first)."""

    status = 409


def check_name(name: str, field: str = "path") -> str:
    """``checkpoint_format.check_name``, a 400 when it refuses."""
    try:
        return checkpoint_format.check_name(name, field)
    except TinkerPathError as e:
        raise CheckpointError(str(e)) from None


def parse_tinker_path(path: str) -> CheckpointRef:
    """``checkpoint_format.parse_tinker_path``, a 400 when it refuses."""
    try:
        return checkpoint_format.parse_tinker_path(path)
    except TinkerPathError as e:
        raise CheckpointError(str(e)) from None


# ---- reading --------------------------------------------------------------------------------


# Reading a version is shared with ``export`` (which reads them with no server running).
read_meta = checkpoint_format.read_meta
_expired = checkpoint_format.expired
resolve = checkpoint_format.resolve


def write_run(root: Path, run_id: str, record: dict[str, Any]) -> None:
    folder = Path(root) / check_name(run_id, "run_id")
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_text(folder / "run.json", json.dumps(record, indent=2) + "\n", fsync=True)


def read_run(root: Path, run_id: str) -> dict[str, Any] | None:
    try:
        return json.loads((Path(root) / check_name(run_id, "run_id") / "run.json").read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def list_runs(root: Path) -> list[dict[str, Any]]:
    runs = []
    for path in Path(root).glob("*/run.json"):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            runs.append(json.loads(path.read_text()))
    return sorted(runs, key=lambda r: r.get("created", 0))


def list_checkpoints(root: Path, run_id: str) -> list[dict[str, Any]]:
    """Metadata of the run's live checkpoints, oldest first."""
    out = []
    for kind in KINDS:
        kind_dir = Path(root) / run_id / kind
        if not kind_dir.is_dir():
            continue
        for entry in kind_dir.iterdir():
            if entry.name.startswith("."):
                continue
            version = resolve(entry)
            meta = read_meta(version) if version else None
            if meta is not None:
                out.append(meta)
    return sorted(out, key=lambda c: c.get("created", 0))


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def read_adapter(directory: str | Path, optimizer: bool):
    """(LoraConfig, state dict, optimizer state or None) from one checkpoint version folder.

    Tensors land on the CPU whatever device saved them; the engine moves them."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import load_file

    folder = Path(directory)
    config = LoraConfig.from_pretrained(str(folder))
    state = load_file(folder / "adapter_model.safetensors", device="cpu")
    optim_state = None
    if optimizer and (folder / "optimizer.pt").exists():
        optim_state = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
    return config, state, optim_state


# ---- writing --------------------------------------------------------------------------------


def write_adapter(
    directory: str | Path,
    state: dict,
    config,
    base_model: str,
    *,
    optimizer: dict | None = None,
    meta: dict[str, Any],
) -> Path:
    """Write a new version of the checkpoint named ``directory`` and point the name at it.

    Returns the version folder. A crash at any point leaves the previous version in place."""
    import copy

    import torch
    from safetensors.torch import save_file

    def fill(version: Path) -> None:
        adapter_config = copy.deepcopy(config)
        adapter_config.base_model_name_or_path = base_model
        adapter_config.save_pretrained(str(version))
        tensors = {k: v.contiguous() for k, v in state.items()}
        save_file(tensors, version / "adapter_model.safetensors")
        if optimizer is not None:
            torch.save(optimizer, version / "optimizer.pt")

    return _write_version(directory, fill, meta)


def write_files(
    directory: str | Path, sources: dict[str, Path], meta: dict[str, Any], exclusive: bool = False
) -> Path:
    """Write a new version of the checkpoint named ``directory`` from files already on disk
    (``{name in the version: source file}``, e.g. an uploaded state staged in
    ``staging_dir``) and point the name at it, as ``write_adapter`` does: a failure at any
    point leaves the previous version in place. The sources are moved (renamed), not copied.
    ``exclusive``: only if no live checkpoint has the name when the name is set (checked at that
    moment, not before a long upload); else ``CheckpointExists`` and nothing is written."""

    def fill(version: Path) -> None:
        for name, source in sources.items():
            os.replace(source, version / name)

    return _write_version(directory, fill, meta, exclusive)


STAGING = ".staging"  # uploads being received and checked, on the checkpoints' own disk


def staging_dir(root: Path) -> Path:
    """Where uploads are staged: under the checkpoints root (same disk, so a checked upload is
    renamed into a version, never copied; not the system temp dir, often RAM). Nothing there
    is a run: listings read ``<root>/<run_id>/run.json`` only."""
    folder = Path(root) / STAGING
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def clear_staging(root: Path) -> None:
    """At start-up: uploads a killed server left half-received."""
    shutil.rmtree(Path(root) / STAGING, ignore_errors=True)


def _write_version(
    directory: str | Path, fill, meta: dict[str, Any], exclusive: bool = False
) -> Path:
    """The one way a checkpoint is written (invariant 3): ``fill(version)`` writes the files
    into a new hidden version folder, ``checkpoint.json`` is added, everything is fsynced, and
    the name ``directory`` is re-pointed at the version in one rename. A failure at any point
    removes the version and leaves the previous one in place."""
    link = Path(directory)
    parent = link.parent
    parent.mkdir(parents=True, exist_ok=True)
    version = parent / f"{VERSION_PREFIX}{link.name}-{time.time_ns()}"
    version.mkdir()
    try:
        fill(version)
        meta = {**meta, "created": time.time(), "size_bytes": folder_size(version)}
        (version / "checkpoint.json").write_text(json.dumps(meta, indent=2) + "\n")
        for path in version.iterdir():
            _fsync(path)
        _fsync(version)
        _point(link, version, exclusive)
    except BaseException:
        shutil.rmtree(version, ignore_errors=True)
        raise
    try:  # the save is done once the name points at it: a failing sweep must not undo that
        sweep_versions(parent)
    except OSError as e:
        _report(parent, e)
    return version


def _point(link: Path, version: Path, exclusive: bool = False) -> None:
    """Make ``link`` name ``version`` in one rename (a real folder from an older layout is
    first moved aside as a version, so it is swept like one). ``exclusive``: a free name is
    taken with one ``symlink`` (which fails if another writer took it first); a live one is
    ``CheckpointExists``."""
    if exclusive:
        try:
            os.symlink(version.name, link)
            _fsync(link.parent)
            return
        except FileExistsError:
            if resolve(link) is not None:
                ref = f"{link.parent.parent.name}/{link.parent.name}/{link.name}"
                raise CheckpointExists(f"path: tinker://{ref} exists here") from None
    if link.is_dir() and not link.is_symlink():
        link.rename(link.parent / f"{VERSION_PREFIX}{link.name}-legacy-{time.time_ns()}")
    previous = Path(os.path.realpath(link)) if link.is_symlink() else None
    tmp_link = link.parent / f".link-{link.name}-{time.time_ns()}"
    os.symlink(version.name, tmp_link)
    os.replace(tmp_link, link)
    _fsync(link.parent)
    if previous is not None:
        _retire(previous)


def update_meta(version: Path, **changes: Any) -> dict[str, Any]:
    """Change fields of a checkpoint's metadata in place (atomic replace of checkpoint.json)."""
    meta = read_meta(version) or {}
    meta.update(changes)
    atomic.write_text(version / "checkpoint.json", json.dumps(meta, indent=2) + "\n", fsync=True)
    return meta


def edit_meta(folder: Path, **changes: Any) -> dict[str, Any] | None:
    """Change the metadata of the checkpoint named ``folder`` (publish, TTL), re-checked at
    commit: if a save re-pointed the name meanwhile, the new version is edited too, so an
    edit is never left on a superseded version only. None if the name resolves to nothing."""
    while (version := resolve(folder)) is not None:
        meta = update_meta(version, **changes)
        if resolve(folder) == version:
            return meta
    return None


def delete(folder: Path) -> bool:
    """Remove a checkpoint: its name goes at once (atomic), so nothing new finds it; its version
    stays for the grace period, so a reader that resolved it before (an archive download, a
    ``load_weights``, a sampler load) finishes, then the sweep removes it. False if absent."""
    if resolve(folder) is None:
        return False
    _unname(folder)
    return True


def _unname(folder: Path) -> None:
    """Take a checkpoint's name away atomically; its version is left for the sweep."""
    version = Path(os.path.realpath(folder)) if folder.is_symlink() else None
    with contextlib.suppress(FileNotFoundError):
        if folder.is_symlink():
            folder.unlink()
        else:  # a real folder from an older layout
            version = folder.parent / f"{VERSION_PREFIX}{folder.name}-gone-{time.time_ns()}"
            folder.rename(version)
    _fsync(folder.parent)
    if version is not None:
        _retire(version)


def _retire(version: Path) -> None:
    """A version just lost its name: its grace period starts now (the sweep reads mtime)."""
    with contextlib.suppress(OSError):
        os.utime(version)


def sweep_versions(kind_dir: Path, grace: float = SWEEP_GRACE_S) -> None:
    """Remove versions no name points to (superseded or interrupted) older than ``grace`` s,
    and links that dangle."""
    live = set()
    now = time.time()
    for entry in list(kind_dir.iterdir()):
        if entry.name.startswith(".link-"):
            if now - _mtime(entry) > grace and entry.is_symlink():
                entry.unlink(missing_ok=True)
        elif not entry.name.startswith(".") and entry.is_symlink():
            try:
                target = os.readlink(entry)
            except FileNotFoundError:  # removed since the listing (a delete, a re-save)
                continue
            if (kind_dir / target).is_dir():
                live.add(target)
            else:
                entry.unlink(missing_ok=True)
    for entry in kind_dir.iterdir():
        unused = entry.name.startswith(VERSION_PREFIX) and entry.name not in live
        if unused and now - _mtime(entry) > grace:
            shutil.rmtree(entry, ignore_errors=True)


def sweep(root: Path, grace: float = SWEEP_GRACE_S) -> int:
    """Expired checkpoints and unreferenced versions under ``root``; returns how many
    checkpoints expired. Run at start-up (grace 0: nobody reads yet) and periodically."""
    expired = 0
    now = time.time()
    for kind_dir in [d for kind in KINDS for d in Path(root).glob(f"*/{kind}")]:
        try:  # one bad folder (a stray file, no permission) does not stop the others
            for entry in list(kind_dir.iterdir()):
                if entry.name.startswith("."):
                    continue
                meta = read_meta(Path(os.path.realpath(entry)))
                if meta is not None and _expired(meta, now):
                    _unname(entry)
                    expired += 1
            sweep_versions(kind_dir, grace)
        except OSError as e:
            _report(kind_dir, e)
    return expired


_reported: set[tuple[str, str]] = set()


def _report(folder: Path, error: OSError) -> None:
    """Log a sweep's failure in ``folder`` once (it would recur at every sweep)."""
    key = (str(folder), type(error).__name__)
    if key not in _reported:
        _reported.add(key)
        log.warning("checkpoint sweep skipped %s: %s (logged once)", folder, error)


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return time.time()


def _fsync(path: Path) -> None:
    """Flush a file or folder to disk (a rename is only durable once its folder is)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and not path.is_symlink() else 0)
    if path.is_symlink():
        return
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""What a checkpoint is called and what its files are: the ``tinker://`` path rules and the
file names of its archives, stated once for the server (which answers 400 on a bad path) and
the client (which refuses the same paths before it asks).

``tinker://<run_id>/<kind>/<name>``: a run id of letters, digits, ``.``, ``_``, ``-`` and ``:``
(tinker>=0.38 names a training client made from a checkpoint ``<session_id>:train:<n>``); a
name without ``:``; neither may hold ``/`` or ``..`` or start with a dot, so a path always
stays inside its folder.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("weights", "sampler_weights", "external_weights")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,255}$")

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a PEFT adapter
ARCHIVE_FILES = (*ADAPTER_FILES, "checkpoint.json")  # every checkpoint archive
STATE_FILES = ("optimizer.pt", "run.json")  # added with include_optimizer (a training state)
RESTORE_FILES = (*ADAPTER_FILES, *STATE_FILES)  # what rlcli restore uploads


class TinkerPathError(ValueError):
    """A bad checkpoint name or path; the message says which and why."""


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    kind: str  # "weights" | "sampler_weights" | "external_weights"
    name: str

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    def folder(self, root: Path) -> Path:
        """The checkpoint's name on disk (a link); ``resolve`` gives the version behind it."""
        return Path(root) / self.run_id / self.kind / self.name


def check_name(name: str, field: str = "path") -> str:
    """A checkpoint or run name that stays inside its folder: no '/', no '..', no dotfiles."""
    pattern = _RUN_ID if field == "run_id" else _NAME
    if not pattern.match(name or "") or ".." in name:
        raise TinkerPathError(
            f"{field}: {name!r} is not a valid checkpoint name "
            "(letters, digits, '.', '_', '-'; no '/' or '..')"
        )
    return name


def parse_tinker_path(path: str) -> CheckpointRef:
    """``tinker://<run_id>/<weights|sampler_weights|external_weights>/<name>`` -> ref."""
    if not path.startswith("tinker://"):
        raise TinkerPathError(f"path: {path!r} is not a tinker:// path")
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise TinkerPathError(
            f"path: {path!r} is not of the form tinker://<run_id>/weights/<name> "
            "or tinker://<run_id>/sampler_weights/<name>"
        )
    return CheckpointRef(check_name(parts[0], "run_id"), parts[1], check_name(parts[2]))


# ---- on disk: read by the server's store and by ``export`` with no server ----------------


def read_meta(version: Path) -> dict[str, Any] | None:
    """A version folder's ``checkpoint.json``, or None (missing, torn)."""
    try:
        return json.loads((Path(version) / "checkpoint.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def expired(meta: dict[str, Any], now: float | None = None) -> bool:
    expires = meta.get("expires_at")
    return expires is not None and expires <= (now or time.time())


def resolve(folder: Path) -> Path | None:
    """The complete, unexpired version folder a checkpoint name points to, or None.

    Read everything of one checkpoint from the returned folder: the name may be re-pointed
    at any moment, the version folder stays whole while it is in use (invariant 3, owned by
    ``server/store/checkpoints.py``, which writes them)."""
    try:
        version = Path(os.path.realpath(folder))
    except OSError:
        return None
    meta = read_meta(version) if version.is_dir() else None
    if meta is None or expired(meta):
        return None
    return version


CHECKPOINT_TTL_HELP = (
    "How long a saved checkpoint is kept: 'client' (what each save asks; the cookbook asks "
    "7 days for its checkpoints, as the hosted service keeps them), 'never' (kept until "
    "deleted), or a time such as 30d, 12h, 90m (every save, whatever it asks)."
)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_checkpoint_ttl(text: str) -> str | float:
    """``--checkpoint-ttl``: "client", "never" or seconds (from ``30d``, ``12h``, ``90m``,
    ``45s``; a bare number is days). ``ValueError`` with the reason otherwise."""
    value = text.strip().lower()
    if value in ("client", "never"):
        return value
    unit = value[-1:] if value[-1:] in _UNITS else "d"
    number = value[:-1] if value[-1:] in _UNITS else value
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError("give client, never, or a time such as 30d, 12h or 90m") from None
    if not 0 < seconds <= 100 * 365 * 86400:
        raise ValueError("give a time above zero and at most 100 years")
    return seconds


def expires_at(rule: str | float, asked_seconds: int | None, now: float) -> float | None:
    """When a checkpoint saved ``now`` expires under the server's ``--checkpoint-ttl`` rule,
    its client having asked ``asked_seconds`` (None: never)."""
    if rule == "never":
        return None
    if rule == "client":
        return now + asked_seconds if asked_seconds else None
    return now + float(rule)

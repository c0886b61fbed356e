"""What a checkpoint is called and what its files are: the ``tinker://`` path rules and the
file names of its archives, stated once for the server (which answers 400 on a bad path) and
the client (which refuses the same paths before it asks).

``tinker://<run_id>/<kind>/<name>``: a run id of letters, digits, ``.``, ``_``, ``-`` and ``:``
(tinker>=0.38 names a training client made from a checkpoint ``<session_id>:train:<n>``); a
name without ``:``; neither may hold ``/`` or ``..`` or start with a dot, so a path always
stays inside its folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

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

"""Where rlcli keeps its state: ``$RLCLI_HOME`` (default ``~/.rlcli``)."""

from __future__ import annotations

import os
from pathlib import Path


def rlcli_home() -> Path:
    return Path(os.environ.get("RLCLI_HOME") or Path.home() / ".rlcli").expanduser()


def checkpoints_dir() -> Path:
    """Where ``serve start`` keeps checkpoints unless ``--checkpoints-dir`` says otherwise, and
    where ``export`` finds them with no server running."""
    return rlcli_home() / "checkpoints"

"""Where rlcli keeps its state: ``$RLCLI_HOME`` (default ``~/.rlcli``)."""

from __future__ import annotations

import os
from pathlib import Path


def rlcli_home() -> Path:
    return Path(os.environ.get("RLCLI_HOME") or Path.home() / ".rlcli").expanduser()

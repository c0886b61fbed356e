"""``rlcli export``: a checkpoint as a PEFT adapter folder or a merged model. (Being built.)"""

from __future__ import annotations


def export() -> None:
    """Export a checkpoint."""
    from rlcli.errors import RlcliError

    raise RlcliError("rlcli export: not built yet")

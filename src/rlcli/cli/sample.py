"""``rlcli sample`` and ``rlcli chat``: talk to a base model or a checkpoint. (Being built.)"""

from __future__ import annotations


def sample() -> None:
    """Sample completions for one prompt."""
    from rlcli.errors import RlcliError

    raise RlcliError("rlcli sample: not built yet")


def chat() -> None:
    """An interactive conversation in the terminal."""
    from rlcli.errors import RlcliError

    raise RlcliError("rlcli chat: not built yet")

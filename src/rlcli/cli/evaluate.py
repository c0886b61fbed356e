"""``rlcli eval``: score a policy on an RL environment. (Being built: issue 12.)"""

from __future__ import annotations

import typer

app = typer.Typer(
    help="Evaluate a policy: reward statistics on an environment.", no_args_is_help=True
)


@app.command("rl")
def rl() -> None:
    """Score a policy on an RL environment."""
    from rlcli.errors import RlcliError

    raise RlcliError("rlcli eval rl: not built yet")

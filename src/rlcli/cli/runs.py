"""``rlcli runs``: list, show, plot and cancel training runs. (Being built.)"""

from __future__ import annotations

import typer

app = typer.Typer(help="Training runs: list, show, plot, cancel.", no_args_is_help=True)


@app.command("list")
def list_() -> None:
    """Every run."""
    from rlcli.errors import RlcliError

    raise RlcliError("rlcli runs list: not built yet")

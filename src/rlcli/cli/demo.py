"""``rlcli demo``: prove the install works, offline, in under a minute."""

from __future__ import annotations

import typer

from rlcli.cli._output import emit, info


def demo(
    steps: int = typer.Option(10, help="Training steps to run."),
    lr: float = typer.Option(5e-3, help="Learning rate."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Smoke-test the install: tiny model, real server, a few SFT steps, offline.

    Builds the tiny model, starts a server, trains through the tinker SDK, stops the server."""
    from rlcli.demo import run_demo
    from rlcli.home import rlcli_home

    losses = run_demo(rlcli_home(), steps, lr, report=info)
    result = {"steps": steps, "first_loss": losses[0], "last_loss": losses[-1]}
    result["loss_went_down"] = losses[-1] < losses[0]
    emit(result, as_json=as_json)

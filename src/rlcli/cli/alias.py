"""``rlcli alias``: stable model names for served checkpoints, switched and rolled back.

Thin over ``rlcli.client.aliases``; the server holds the table (``server/state/aliases.py``).
"""

from __future__ import annotations

import time

import typer

from rlcli.cli._output import JSON, emit
from rlcli.cli.sample import BASE_URL

app = typer.Typer(
    help="Aliases: a model name at /v1 (and for sample, chat, eval, learn) that serves one "
    "checkpoint at a time; every switch logged, rolled back in one command.",
    no_args_is_help=True,
)
WHY = typer.Option("", "--why", help="Why: kept in the alias's history.")


def _url(base_url: str | None) -> str:
    """The server, probed once (``endpoint.check_server``): not there, or not a Tinker server,
    is one line within seconds."""
    from rlcli.client import endpoint

    url, source = endpoint.resolve_base_url(base_url)
    endpoint.check_server(url, source=source)
    return url


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


@app.command("set")
def set_(
    name: str = typer.Argument(..., help="Alias name (a letter, then letters, digits, . _ -)."),
    checkpoint: str = typer.Argument(
        ..., help="tinker://RUN/sampler_weights/NAME, or the base model, to serve under NAME."
    ),
    state: str = typer.Option(
        None, "--state", help="Its training state (default: tinker://RUN/weights/NAME if saved)."
    ),
    why: str = WHY,
    base_url: str = BASE_URL,
    as_json: bool = JSON,
) -> None:
    """Serve CHECKPOINT under NAME from the next request on (requests in flight finish on the
    old one)."""
    from rlcli.client import aliases

    _emit(aliases.set_alias(_url(base_url), name, checkpoint, state=state, why=why), as_json)


@app.command("list")
def list_(base_url: str = BASE_URL, as_json: bool = JSON) -> None:
    """Every alias: the version and checkpoint it serves."""
    from rlcli.client import aliases

    rows = aliases.listing(_url(base_url))
    if as_json:
        emit(rows, as_json=True)
        return
    emit([{"alias": r["name"], "version": f"{r['current']}/{r['versions']}",
           "checkpoint": r["checkpoint"], "updated": _when(r["updated"])} for r in rows]
         or "no aliases", as_json=False)  # fmt: skip


@app.command("history")
def history(name: str = typer.Argument(...), base_url: str = BASE_URL, as_json: bool = JSON):
    """Every switch of NAME: when, to which version, by whom, why."""
    from rlcli.client import aliases

    table = aliases.history(_url(base_url), name)
    if as_json:
        emit(table, as_json=True)
        return
    emit([{"time": _when(e["time"]), "action": e["action"], "version": e["version"],
           "from": e["from"] or "", "checkpoint": e["checkpoint"], "by": e["by"],
           "why": e["why"]} for e in table["log"]], as_json=False)  # fmt: skip


@app.command("rollback")
def rollback(
    name: str = typer.Argument(...),
    to: int = typer.Option(None, "--to", min=1, help="Version to serve (default: the previous)."),
    why: str = WHY,
    base_url: str = BASE_URL,
    as_json: bool = JSON,
) -> None:
    """Serve an earlier version of NAME again (logged as a switch)."""
    from rlcli.client import aliases

    _emit(aliases.rollback(_url(base_url), name, to, why=why), as_json)


def _emit(described: dict, as_json: bool) -> None:
    emit(described if as_json else {**described, "updated": _when(described["updated"])},
         as_json=as_json)  # fmt: skip

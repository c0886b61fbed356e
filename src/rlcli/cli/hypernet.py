"""``rlcli hypernet internalize``: a document into a LoRA with one forward pass of a trained
doc-to-LoRA hypernetwork (``rlcli train d2l``); the library call is ``client/d2l.internalize``."""

from __future__ import annotations

import sys

import typer

from rlcli.cli._output import JSON, emit

app = typer.Typer(
    help="Doc-to-LoRA hypernetworks (train one with: rlcli train d2l).", no_args_is_help=True
)


@app.command("internalize")
def internalize(
    document: str = typer.Argument(..., help="A text file (or - for stdin)."),
    hypernet: str = typer.Option(
        ..., "--hypernet", help="tinker://ID/hypernet_weights/NAME (train d2l's hypernet_path)."
    ),
    base_url: str = typer.Option(
        None, "--base-url", help="The server (default: the one running here)."
    ),
    name: str = typer.Option(
        None, "--name", help="The adapter's checkpoint name (default: doc-<random>)."
    ),
    session_key: str = typer.Option(
        None,
        "--session-key",
        help="The same key returns the same adapter without recomputing it (and renews its TTL); "
        "default: none, each call makes a new adapter.",
    ),
    ttl: int = typer.Option(
        None, "--ttl", min=1, help="Seconds an adapter lives unless renewed (default: 86400)."
    ),
    pin: bool = typer.Option(False, "--pin", help="Keep the adapter until deleted (no TTL)."),
    as_json: bool = JSON,
) -> None:
    """Make the document's LoRA on the server and print its sampler path: sample it with
    rlcli sample/chat --checkpoint PATH, /v1 with model=PATH, or export it. The same as
    rlcli internalize DOCUMENT --hypernet PATH (which prints it as sampler_path)."""
    from rlcli.client.d2l import internalize as run

    out = run(
        document, hypernet, base_url=base_url, name=name, session_key=session_key,
        ttl_seconds=ttl, pin=pin, stdin=sys.stdin,
    )  # fmt: skip
    emit(out, as_json=as_json, title="internalized")

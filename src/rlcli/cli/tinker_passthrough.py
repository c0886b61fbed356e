"""``rlcli checkpoint | run | session ...``: the official ``tinker`` CLI, pointed at a server.

The tinker CLI has no ``--base-url``; it reads ``TINKER_BASE_URL``. We set it from
``endpoint.resolve_base_url`` (``--base-url``, ``TINKER_BASE_URL``, the server ``rlcli serve``
runs here, then http://localhost:8000) and check first that the server answers: the tinker CLI
retries a dead server silently for minutes. ``TINKER_API_KEY`` defaults to ``tml-dummy``.
"""

from __future__ import annotations

import os
import sys

import typer

GROUPS = {
    "checkpoint": "Checkpoints on the server (list, info, download, delete, ...), via `tinker`.",
    "run": "Training runs on the server (list, info), via `tinker`.",
    "session": "Sessions on the server, via `tinker`.",
}
CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def tinker_command(group: str, args: list[str]) -> list[str]:
    """``tinker`` takes ``-f/--format`` before the group; accept it anywhere and move it."""
    front, rest = [], []
    i = 0
    while i < len(args):
        if args[i] in ("-f", "--format") and i + 1 < len(args):
            front += [args[i], args[i + 1]]
            i += 2
            continue
        if args[i].startswith("--format="):
            front.append(args[i])
        elif args[i] == "--json":
            front += ["--format", "json"]
        else:
            rest.append(args[i])
        i += 1
    return [sys.executable, "-m", "tinker.cli", *front, group, *rest]


def make_command(group: str):
    def command(
        ctx: typer.Context,
        base_url: str = typer.Option(
            None, "--base-url", help="Server to talk to (wins over TINKER_BASE_URL)."
        ),
    ) -> None:
        from rlcli.client import endpoint

        args = list(ctx.args) or ["--help"]
        url, source = endpoint.resolve_base_url(base_url)
        if not {"--help", "-h"} & set(args):
            endpoint.check_server(url, source=source)
        env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": endpoint.api_key()}
        argv = tinker_command(group, args)
        os.execve(argv[0], argv, env)

    command.__doc__ = GROUPS[group] + " Everything after the group goes to `tinker`."
    return command


def register(app: typer.Typer) -> None:
    for group, text in GROUPS.items():
        app.command(group, context_settings=CONTEXT, help=text)(make_command(group))

"""The ``rlcli`` command. Thin: each group parses flags and calls the library.

Heavy imports (torch, transformers, tinker) happen inside commands, so ``rlcli --help`` is fast.
Known errors (``RlcliError``) become one line on stderr and exit code 1.
"""

from __future__ import annotations

import sys

import typer

from rlcli.cli import demo, importer, models, serve, tinker_passthrough, train

app = typer.Typer(
    name="rlcli",
    help="Post-train open-weight LLMs on your own hardware through the Tinker API.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(serve.app, name="serve")
app.add_typer(models.app, name="models")
app.add_typer(train.app, name="train")
app.command("demo")(demo.demo)
app.command("import")(importer.import_)
tinker_passthrough.register(app)


def main() -> None:
    from rlcli.errors import RlcliError

    try:
        app()
    except RlcliError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)


if __name__ == "__main__":
    main()

"""The ``rlcli`` command. Thin: each group parses flags and calls the library.

Heavy imports (torch, transformers, tinker) happen inside commands, so ``rlcli --help`` is fast.
Known errors (``RlcliError``) become one line on stderr and their exit code (1, or 128 + the
signal that stopped a run); so do usage errors (an unknown option or command, a missing or
malformed value: exit 2), which click would print as a usage block and typer as a box; Ctrl-C
anywhere else exits 130; a closed output pipe (``rlcli ... | head``) ends quietly with 141, as a
shell reports SIGPIPE.
"""

from __future__ import annotations

import os
import sys

import typer

from rlcli.cli import (
    alias,
    demo,
    evaluate,
    export,
    hypernet,
    importer,
    internalize,
    learn,
    models,
    redact,
    runs,
    sample,
    serve,
    tinker_passthrough,
    traces,
    train,
)
from rlcli.errors import Cancelled, RlcliError

try:  # typer 0.2x parses with its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # older typer: click itself
    from click import exceptions as click_errors

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
internalize.register(app)
app.add_typer(evaluate.app, name="eval")
app.add_typer(runs.app, name="runs")
app.add_typer(traces.app, name="traces")
app.add_typer(alias.app, name="alias")
app.add_typer(learn.app, name="learn")
app.add_typer(hypernet.app, name="hypernet")
app.command("sample")(sample.sample)
app.command("chat")(sample.chat)
export.register(app)
demo.register(app)
app.command("import")(importer.import_)
app.command("redact")(redact.redact)
tinker_passthrough.register(app)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("rlcli")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _version_callback(value: bool) -> None:
    if value:
        print(f"rlcli {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False,
        "--version",
        callback=_version_callback,
        is_eager=True,
        help="Print rlcli's version and exit.",
    ),
) -> None:
    """Post-train open-weight LLMs on your own hardware through the Tinker API."""


def _say(message: str) -> None:
    try:
        sys.stderr.write(message)
        sys.stderr.flush()
    except (BrokenPipeError, OSError):  # stderr is a closed pipe too: nothing to tell
        pass


def _quiet_exit(code: int) -> None:
    """Exit without Python's "Exception ignored ... BrokenPipeError" on a closed stdout."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(code)


def usage_line(error: click_errors.ClickException) -> str:
    """One line for a usage error: which command, what was wrong, where to look."""
    message = " ".join(error.format_message().split())
    ctx = getattr(error, "ctx", None)
    if ctx is None:
        return f"error: {message}"
    return f"error: {ctx.command_path}: {message} (see '{ctx.command_path} --help')"


def main() -> None:
    try:
        # not standalone: click's usage errors reach us, to print as one line
        code = app(prog_name="rlcli", standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except click_errors.NoArgsIsHelpError as e:  # a bare group: its help, as click does
        e.show()
        sys.exit(e.exit_code)
    except click_errors.ClickException as e:
        _say(usage_line(e) + "\n")
        sys.exit(e.exit_code)
    except typer.Abort:  # end of input at a prompt
        _say("aborted\n")
        sys.exit(1)
    except RlcliError as e:
        _say(f"{e}\n" if isinstance(e, Cancelled) else f"error: {e}\n")
        if e.exit_code == 141:
            _quiet_exit(141)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _say("interrupted\n")
        sys.exit(130)
    except BrokenPipeError:
        _quiet_exit(141)
    except SystemExit:
        try:  # output still buffered for a pipe that has closed (`rlcli ... --json | head -1`)
            sys.stdout.flush()
        except BrokenPipeError:
            _quiet_exit(141)
        raise


if __name__ == "__main__":
    main()

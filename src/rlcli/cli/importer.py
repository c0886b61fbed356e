"""``rlcli import``: chat logs -> training JSONL (``{"messages": [...]}`` per line)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from rlcli.cli._output import info
from rlcli.errors import RlcliError
from rlcli.files import atomic


def import_(
    source: str = typer.Argument(..., help="A JSONL dump, or - for stdin."),
    fmt: str = typer.Option(
        ..., "--format", "-f", help="openai | anthropic | messages | sharegpt."
    ),
    output: Path = typer.Option(None, "--output", "-o", help="Write here (default: stdout)."),
    min_messages: int = typer.Option(2, help="Skip conversations with fewer messages."),
    limit: int = typer.Option(None, help="Stop after this many conversations."),
    keep_tools: bool = typer.Option(False, help="Keep tool calls and results, as text."),
    strict: bool = typer.Option(False, help="Any bad line is fatal (nothing is written)."),
) -> None:
    """Convert chat logs to the JSONL that `rlcli train sl` reads.

    Bad lines are reported by number on stderr; conversations without an assistant turn are
    skipped and counted."""
    from rlcli.data.importers import FORMATS, ImportReport, import_lines

    if fmt not in FORMATS:
        raise RlcliError(f"--format {fmt}: unknown format; choose from {', '.join(FORMATS)}")
    if source == "-":
        lines, name = sys.stdin, "stdin"
    else:
        path = Path(source)
        if not path.is_file():
            raise RlcliError(f"{source}: no such file")
        lines, name = path.open(encoding="utf-8", errors="replace"), source
    report = ImportReport()
    rows = import_lines(
        lines, fmt, keep_tools=keep_tools, min_messages=min_messages, limit=limit, report=report
    )
    if output is None and not strict:
        for row in rows:
            sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:  # buffer: with --strict nothing is written unless every line is good
        kept = list(rows)
        if strict and report.errors:
            _report(report, name)
            raise RlcliError(f"{name}: {len(report.errors)} bad lines (--strict); nothing written")
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in kept)
        if output is None:
            sys.stdout.write(text)
        else:
            output.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_text(output, text)
    _report(report, name)
    if report.written == 0:
        raise RlcliError(f"{name}: no usable conversations ({report.summary()})")


def _report(report, name: str) -> None:
    for error in report.errors[:20]:
        info(f"{name}: {error}")
    if len(report.errors) > 20:
        info(f"{name}: ... and {len(report.errors) - 20} more bad lines")
    info(f"{name}: {report.summary()}")

"""One place that renders results: a table or key/value list for people, JSON for scripts."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import typer

# The --json switch most commands share (a few word their help for what they print).
JSON = typer.Option(False, "--json", help="Print the result as JSON.")


def emit(data: Any, *, as_json: bool, title: str | None = None) -> None:
    """``data`` as JSON, or for people: a mapping as key/value lines, a list of mappings as a
    table. No value is ever cut: a table wider than the terminal (80 columns when piped) is
    printed as plain aligned text instead, whose long lines the terminal wraps whole, so a
    checkpoint path can always be copied."""
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        return
    from rich.console import Console

    console = Console()
    if isinstance(data, dict):
        rows = [[str(k), "" if v is None else str(v)] for k, v in data.items()]
        _table(console, None, rows, title, boxed=False)
    elif isinstance(data, list) and data and isinstance(data[0], dict):
        header = [str(k) for k in data[0]]
        rows = [["" if v is None else str(v) for v in row.values()] for row in data]
        _table(console, header, rows, title, boxed=True)
    else:
        console.print(data)


def _table(console, header: list[str] | None, rows: list[list[str]], title, boxed: bool):
    """A Rich table when it fits the console, else the same cells as plain aligned text."""
    cells = [header, *rows] if header else rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    # Rich pads each cell by one space on either side, plus one rule per column when boxed.
    natural = sum(widths) + len(widths) * (3 if boxed else 2) + (1 if boxed else -2)
    if natural <= console.width:
        from rich.table import Table

        if boxed:
            table = Table(title=title)
            for name in header or []:
                table.add_column(name)
        else:
            table = Table(title=title, show_header=False, box=None, pad_edge=False)
            table.add_column(style="bold")
            table.add_column()
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    lines = [title] if title else []
    for i, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if header and i == 0:
            lines.append("  ".join("-" * w for w in widths))
    sys.stdout.write("\n".join(lines) + "\n")


def info(message: str) -> None:
    """Human progress/status lines go to stderr, so stdout stays clean for pipes and --json."""
    sys.stderr.write(message + "\n")


@contextlib.contextmanager
def whole_output(output: Path | None) -> Iterator[TextIO]:
    """A file to write into that reaches ``output`` (replaced whole, ``files.atomic``) or
    stdout only when the block ends without an error: a command that fails halfway (a
    redaction that fails closed) leaves no part of its output anywhere."""
    if output is not None:
        from rlcli.files import atomic

        output.parent.mkdir(parents=True, exist_ok=True)
        with atomic.replacing(output) as tmp, tmp.open("w", encoding="utf-8") as f:
            yield f
        return
    with tempfile.TemporaryFile("w+", encoding="utf-8") as f:
        yield f
        f.seek(0)
        shutil.copyfileobj(f, sys.stdout)

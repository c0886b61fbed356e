"""One place that renders results: a table or key/value list for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit(data: Any, *, as_json: bool, title: str | None = None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if isinstance(data, dict):
        table = Table(title=title, show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column()
        for key, value in data.items():
            table.add_row(str(key), "" if value is None else str(value))
        console.print(table)
    elif isinstance(data, list) and data and isinstance(data[0], dict):
        table = Table(title=title)
        for key in data[0]:
            table.add_column(str(key))
        for row in data:
            table.add_row(*("" if v is None else str(v) for v in row.values()))
        console.print(table)
    else:
        console.print(data)


def info(message: str) -> None:
    """Human progress/status lines go to stderr, so stdout stays clean for pipes and --json."""
    sys.stderr.write(message + "\n")

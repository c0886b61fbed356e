"""``rlcli import``: chat logs and traces -> training JSONL (``{"messages": [...]}`` per line;
traces add ``tools``, ``feedback`` and ``origin``), PII redacted on the way with --redact."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import typer

from rlcli.cli._output import info, whole_output
from rlcli.cli.redact import ENTITIES, NER_MODEL, redactor
from rlcli.errors import RlcliError


def import_(
    source: str = typer.Argument(..., help="A JSONL dump, or - for stdin."),
    fmt: str = typer.Option(
        "auto",
        "--format",
        "-f",
        help="openai | anthropic | messages | sharegpt (chat logs); langsmith | langfuse | otel "
        "(traces, with tools and feedback); auto: the one that keeps the most of the first "
        "500 lines. A format that keeps less than another would is refused, naming it.",
    ),
    output: Path = typer.Option(None, "--output", "-o", help="Write here (default: stdout)."),
    min_messages: int = typer.Option(2, help="Skip conversations with fewer messages."),
    limit: int = typer.Option(None, help="Stop after this many conversations."),
    keep_tools: bool = typer.Option(
        False, help="Chat-log formats: keep tool calls and results, as text (traces keep them)."
    ),
    strict: bool = typer.Option(False, help="Any bad line is fatal (nothing is written)."),
    redact: bool = typer.Option(
        False, "--redact", help="Replace PII with placeholders (see `rlcli redact`)."
    ),
    entities: str = ENTITIES,
    ner_model: Path = NER_MODEL,
) -> None:
    """Convert chat logs or traces to the JSONL that `rlcli train sl` reads.

    Bad lines are reported by number on stderr; conversations without an assistant turn are
    skipped and counted; what a trace holds that no row can is counted by name. With
    --redact, nothing is written unless every conversation was redacted."""
    from rlcli.data import import_format
    from rlcli.data.importers import ALL_FORMATS, ImportReport, import_lines

    if fmt not in (*ALL_FORMATS, "auto"):
        raise RlcliError(
            f"--format {fmt}: unknown format; choose from {', '.join(ALL_FORMATS)} or auto"
        )
    if (entities or ner_model) and not redact:
        raise RlcliError("--entities and --ner-model choose what --redact removes: add --redact")
    if source == "-":
        lines, name = sys.stdin, "stdin"
    else:
        path = Path(source)
        if not path.is_file():
            raise RlcliError(f"{source}: no such file")
        lines, name = path.open(encoding="utf-8", errors="replace"), source
    sample = list(itertools.islice(lines, import_format.SAMPLE_LINES))
    fmt, chosen = import_format.choose(sample, fmt, name)  # before Presidio, before a write
    if chosen:
        info(chosen)
    lines = itertools.chain(sample, lines)
    scrub = redactor(entities, ner_model) if redact else None  # loads Presidio: seconds
    report = ImportReport()
    rows = import_lines(
        lines, fmt, keep_tools=keep_tools, min_messages=min_messages, limit=limit, report=report
    )
    if output is None and not strict and scrub is None:
        for row in rows:
            sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:  # whole or nothing: --strict with a bad line, or a redaction that fails
        with whole_output(output) as out:
            redaction = _write(rows, out, scrub, name)
            if strict and report.errors:
                report.discarded = True
                _report(report, name)
                raise RlcliError(
                    f"{name}: {len(report.errors)} bad lines (--strict); nothing written"
                )
        if redaction is not None:
            info(f"{name}: {redaction.summary()}")
    _report(report, name)
    if report.written == 0:
        raise RlcliError(f"{name}: no usable conversations ({report.summary()})")


def _write(rows, out, scrub, name: str):
    """Write each row (redacted first with ``scrub``); the redaction report, or None."""
    if scrub is None:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
        return None
    from rlcli.data.redaction import RedactionError, RedactionReport

    total = RedactionReport()
    for number, row in enumerate(rows, start=1):
        try:
            row, found = scrub.redact_conversation(row)
        except RedactionError as e:
            raise RlcliError(f"{name}: conversation {number}: {e}; nothing written") from None
        total.add(found)
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return total


def _report(report, name: str) -> None:
    for error in report.errors[:20]:
        info(f"{name}: {error}")
    if len(report.errors) > 20:
        info(f"{name}: ... and {len(report.errors) - 20} more bad lines")
    info(f"{name}: {report.summary()}")

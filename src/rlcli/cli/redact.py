"""``rlcli redact``: PII out of chat JSONL (imports, captured traces), by the library in
``rlcli.data.redaction``; fail-closed: on any error nothing is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from rlcli.cli._output import JSON, info, whole_output
from rlcli.errors import RlcliError

ENTITIES = typer.Option(
    None,
    "--entities",
    help="Comma-separated Presidio entities to redact (default: EMAIL_ADDRESS, PHONE_NUMBER, "
    "CREDIT_CARD, IP_ADDRESS, IBAN_CODE, US_SSN; PERSON, LOCATION, ORGANIZATION with --ner-model).",
)
NER_MODEL = typer.Option(
    None,
    "--ner-model",
    help="A local spaCy pipeline or transformers token-classification folder: also redact "
    "names, places and organisations.",
)


def redactor(entities: str | None, ner_model: Path | None):
    """The one Redactor a command uses (building it loads Presidio: seconds)."""
    from rlcli.data.redaction import Redactor

    names = [e.strip() for e in entities.split(",") if e.strip()] if entities else None
    return Redactor(names, ner_model=str(ner_model) if ner_model else None)


def redact(
    source: str = typer.Argument(..., help="A JSONL file (one conversation per line), or -."),
    output: Path = typer.Option(None, "--output", "-o", help="Write here (default: stdout)."),
    entities: str = ENTITIES,
    ner_model: Path = NER_MODEL,
    as_json: bool = JSON,
) -> None:
    """Replace emails, phone numbers, card numbers, IPs (...) in every string of each row
    with placeholders (<EMAIL_1>), the same value the same placeholder within a row.

    Prints what was redacted, by type and count (never the values), on stderr; --json prints
    it as JSON (on stdout with -o, else on stderr). Any bad line or failed redaction: nothing
    is written."""
    from rlcli.data.redaction import RedactionError, RedactionReport

    if source == "-":
        lines, name = sys.stdin, "stdin"
    else:
        path = Path(source)
        if not path.is_file():
            raise RlcliError(f"{source}: no such file")
        lines, name = path.open("rb"), source
    scrub = redactor(entities, ner_model)
    report = RedactionReport()
    with whole_output(output) as out:
        for number, line in _numbered(lines, name):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise RlcliError(
                    f"{name}: line {number}: not JSON ({e.msg} at column {e.colno}); "
                    "nothing written"
                ) from None
            if not isinstance(row, dict):
                raise RlcliError(
                    f"{name}: line {number}: expected a JSON object (a conversation), got "
                    f"{type(row).__name__}; nothing written"
                )
            try:
                redacted, found = scrub.redact_conversation(row)
            except RedactionError as e:
                raise RlcliError(f"{name}: line {number}: {e}; nothing written") from None
            report.add(found)
            out.write(json.dumps(redacted, ensure_ascii=False) + "\n")
        if report.rows == 0:
            raise RlcliError(f"{name}: no rows to redact")
    info(f"{name}: {report.summary()}")
    if as_json:
        stream = sys.stdout if output is not None else sys.stderr
        stream.write(json.dumps(report.as_dict(), indent=2) + "\n")


def _numbered(stream, name: str):
    """``(number, line)`` for each non-blank line, decoded line by line so that text which is
    not UTF-8 is reported on its own line."""
    for number, raw in enumerate(getattr(stream, "buffer", stream), start=1):
        try:
            line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError:
            raise RlcliError(f"{name}: line {number}: not UTF-8 text; nothing written") from None
        if line.strip():
            yield number, line

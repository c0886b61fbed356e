"""``rlcli traces list|show|export``: what ``serve start --capture`` recorded and the verdicts
on it (``rlcli.traces``), as tables, JSON, or training rows."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rlcli.cli._output import JSON, emit, info, whole_output
from rlcli.errors import RlcliError

app = typer.Typer(
    help="Captured /v1 traffic and its feedback: list, show, export as training data.",
    no_args_is_help=True,
)

FOLDER = typer.Option(None, "--dir", help="The capture folder (default $RLCLI_HOME/traces).")
SINCE = typer.Option(
    None, help="Only traces from this time on: ISO (2026-12-01T09:00) or an age (12h, 7d)."
)
UNTIL = typer.Option(None, help="Only traces up to this time (ISO or an age).")
MODEL = typer.Option(
    None, help="Only traces asked of this model name or answered by this checkpoint."
)
KEY = typer.Option(None, help="Only traces with a verdict of this feedback key (and scores of it).")
MIN_SCORE = typer.Option(None, help="Only traces with a verdict scored at least this.")
MAX_SCORE = typer.Option(None, help="Only traces with a verdict scored at most this.")

AS_HELP = (
    "sft (train sl) | dpo (train dpo) | prompts (train rl --dataset) | judged (every judged "
    "answer with its verdicts: learn --traces)."
)


def _filters(since, until, model, key, min_score, max_score, limit=None):
    from rlcli.traces.catalog import Filters

    if limit is not None and limit < 1:
        raise RlcliError(f"--limit {limit}: must be at least 1")
    return Filters(since, until, model, key, min_score, max_score, limit)


@app.command("list")
def list_(
    folder: Path = FOLDER, since: str = SINCE, until: str = UNTIL, model: str = MODEL,
    key: str = KEY, min_score: float = MIN_SCORE, max_score: float = MAX_SCORE,
    limit: int = typer.Option(50, help="The newest N traces that pass the filters."),
    as_json: bool = JSON,
) -> None:  # fmt: skip
    """One line per captured exchange: id, time, model, what was asked, the answer, verdicts."""
    from rlcli.traces import catalog

    traces = catalog.load(folder, _filters(since, until, model, key, min_score, max_score, limit))
    rows = [catalog.summary(t) for t in traces]
    if as_json:
        emit(rows, as_json=True)
        return
    if not rows:
        info("no traces match")
        return
    for row in rows:
        row["asked"], row["answer"] = _short(row["asked"]), _short(row["answer"])
        del row["latency_s"]
    emit(rows, as_json=False)


@app.command("show")
def show(
    trace_id: str = typer.Argument(..., help="A trace id (a completion's id)."),
    folder: Path = FOLDER,
    as_json: bool = JSON,
) -> None:
    """One trace whole: request, answer, tokens, logprobs, verdicts (JSON)."""
    from rlcli.traces import catalog

    trace = catalog.find(folder, trace_id)
    if as_json:
        emit(trace, as_json=True)
        return
    typer.echo(json.dumps(trace, indent=2, ensure_ascii=False))


@app.command("export")
def export(
    kind: str = typer.Option(..., "--as", help=AS_HELP),
    output: Path = typer.Option(None, "--output", "-o", help="Write here (default: stdout)."),
    folder: Path = FOLDER, since: str = SINCE, until: str = UNTIL, model: str = MODEL,
    key: str = KEY,
    min_score: float = typer.Option(
        1.0, help="sft: answers with a verdict scored at least this (and every correction)."
    ),
    as_json: bool = JSON,
) -> None:  # fmt: skip
    """Training rows from the traces: SFT rows from well-scored answers and corrections, DPO
    pairs (a correction against the answer it corrected), or RL prompts with their recorded
    tool outputs and verdicts. Prints what was written and skipped on stderr."""
    from rlcli.traces import catalog
    from rlcli.traces import export as exporting

    if kind not in exporting.KINDS:
        raise RlcliError(f"--as {kind}: choose from {', '.join(exporting.KINDS)}")
    traces = catalog.load(folder, _filters(since, until, model, key, None, None))
    rows, skipped = exporting.rows(traces, kind, min_score=min_score, key=key)
    with whole_output(output) as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    report = {"traces": len(traces), "rows": len(rows), "skipped": dict(skipped)}
    if as_json and output is not None:
        emit(report, as_json=True)
        return
    why = "; ".join(f"{n} {reason}" for reason, n in skipped.items())
    info(
        f"read {len(traces)} traces, wrote {len(rows)} {kind} rows"
        + (f"; skipped {why}" if why else "")
    )


def _short(text: str | None, width: int = 40) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"

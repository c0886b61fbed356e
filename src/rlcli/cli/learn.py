"""``rlcli learn``: one round of the continual-learning loop on an alias (or ``--watch``:
a round whenever enough new judged traces have arrived), and ``learn status|history``.

Thin over ``rlcli.learn``; what a round does is in ``learn/round.py``.
"""

from __future__ import annotations

import time

import typer

from rlcli.cli._output import JSON, emit, info
from rlcli.cli.sample import BASE_URL
from rlcli.errors import RlcliError

app = typer.Typer(
    help="The continual-learning loop: judged traces -> train from the alias's state -> "
    "evaluate beside the served adapter -> promote through a gate -> a receipt.",
)
ALIAS = typer.Option(None, "--alias", help="The alias to improve (rlcli alias list).")


@app.callback(invoke_without_command=True)
def learn(
    ctx: typer.Context,
    alias: str = ALIAS,
    traces: list[str] = typer.Option(
        None,
        "--traces",
        help="JSONL file or folder of judged traces (rlcli import -f "
        "langsmith|langfuse|otel output); repeatable.",
    ),
    method: str = typer.Option(
        "auto",
        "--method",
        help="auto | sl (corrections and answers judged good become SFT rows) | dpo (a "
        "correction against the answer it corrected) | rl (train rl on the logged prompts, "
        "graded by --reward, else by exact match to the right answer). auto: rl when the "
        "verdicts are scores with no right answer and --reward is given, else sl.",
    ),
    held_out: float = typer.Option(
        0.25,
        "--held-out",
        min=0.0,
        max=0.9,
        help="Share of new traces held out (rounded, at least one), by a hash of the trace id.",
    ),
    min_traces: int = typer.Option(
        8, "--min-traces", min=1, help="New judged traces a round needs."
    ),
    margin: float = typer.Option(
        1.0, "--margin", help="Held-out points (0-100) the candidate must gain to be promoted."
    ),
    max_regression: float = typer.Option(
        2.0, "--max-regression", min=0.0, help="Points the regression set may drop."
    ),
    regression: str = typer.Option(
        None,
        "--regression",
        help="Judged traces to guard against "
        "regressions (default: the first round's held-out, frozen).",
    ),
    reward: str = typer.Option(
        None,
        "--reward",
        help="FILE.py:FN(question, answer, "
        "reference=...) -> float, instead of matching the right answer: it scores the gate's "
        "answers and, with --method rl, the rollouts.",
    ),
    judge: str = typer.Option(
        None,
        "--judge",
        help="A model that scores the gate pairwise instead: for each held-out and regression "
        "question it picks the better of the current and the candidate answer, asked in both "
        "orders (a split or unreadable verdict is a tie); candidate 1 / 0.5 / 0 a question.",
    ),
    judge_base_url: str = typer.Option(
        None,
        "--judge-base-url",
        help="The judge's OpenAI-compatible server (default: the server learn trains on).",
    ),
    judge_api_key: str = typer.Option(
        None,
        "--judge-api-key",
        help="The judge server's API key (default: on the server learn trains on, the key "
        "rlcli sends it; on another, $OPENAI_API_KEY).",
    ),
    epochs: int = typer.Option(
        3, "--epochs", min=1, help="Passes over a round's rows (rl: over its prompts)."
    ),
    lr: float = typer.Option(1e-4, "--learning-rate", "--lr", min=0.0, help="Learning rate."),
    batch_size: int = typer.Option(
        8, "--batch-size", min=1, help="Rows per step (rl: prompts per step)."
    ),
    group_size: int = typer.Option(
        4, "--group-size", min=2, help="rl: answers sampled per prompt (a group)."
    ),
    lora_rank: int = typer.Option(16, "--lora-rank", min=1, help="LoRA rank of a first round."),
    max_tokens: int = typer.Option(
        64, "--max-tokens", min=1, help="Longest evaluated answer (rl: and sampled rollout)."
    ),
    seed: int = typer.Option(0, "--seed", min=0),
    watch: bool = typer.Option(
        False,
        "--watch",
        help="Repeat: a round whenever --min-traces new judged traces have arrived; Ctrl-C stops.",
    ),
    every: float = typer.Option(30.0, "--every", min=0.1, help="--watch: seconds between looks."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the round's plan; train nothing."),
    base_url: str = BASE_URL,
    as_json: bool = JSON,
) -> None:
    if ctx.invoked_subcommand:
        return
    if not alias:
        raise RlcliError("learn: pass --alias NAME (rlcli alias set NAME CHECKPOINT makes one)")
    from rlcli.learn.round import LearnOptions, NotEnoughTraces, run_round

    opts = LearnOptions(
        alias=alias,
        traces=list(traces or []),
        base_url=base_url,
        method=method,
        held_out=held_out,
        min_traces=min_traces,
        margin=margin,
        max_regression=max_regression,
        regression=regression,
        reward=reward,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        group_size=group_size,
        lora_rank=lora_rank,
        max_tokens=max_tokens,
        seed=seed,
        dry_run=dry_run,
        judge=judge,
        judge_base_url=judge_base_url,
        judge_api_key=judge_api_key,
    )
    if not watch:
        _show(run_round(opts, info), as_json)
        return
    try:
        while True:
            try:
                _show(run_round(opts, info), as_json)
            except NotEnoughTraces as e:
                info(f"waiting: {e}")
                time.sleep(every)
    except KeyboardInterrupt:
        raise RlcliError(
            "learn --watch: stopped (an unfinished round continues on the next run)", exit_code=130
        ) from None


def _show(result: dict, as_json: bool) -> None:
    if as_json:
        emit(result, as_json=True)
        return
    if "decision" not in result:  # a dry run's plan
        emit(
            {
                "round": result["round"],
                "method": result["method"],
                **result["traces"],
                "serves": result["current"]["checkpoint"],
            },
            as_json=False,
        )
        return
    shown = {
        "round": result["round"],
        "decision": result["decision"],
        "why": result["why"],
        "candidate": result["candidate"]["checkpoint"],
    }
    for name, verdicts in (result.get("judge") or {}).items():
        if isinstance(verdicts, dict):  # held_out, regression: the candidate's pairs
            shown[f"judge {name}"] = "{wins} won, {ties} tied, {losses} lost".format(**verdicts)
    emit(shown | {"seconds": result["seconds"]}, as_json=False)


@app.command("status")
def status(alias: str = ALIAS, as_json: bool = JSON) -> None:
    """The alias's rounds: how many, and where the last one stands."""
    from rlcli.learn import report

    emit(report.status(_needed(alias)), as_json=as_json)


@app.command("history")
def history(alias: str = ALIAS, as_json: bool = JSON) -> None:
    """Every round of the alias: decision, held-out score before -> after, why."""
    from rlcli.learn import report

    rows = report.history(_needed(alias))
    emit(rows if rows or as_json else "no rounds yet", as_json=as_json)


def _needed(alias: str | None) -> str:
    if not alias:
        raise RlcliError("pass --alias NAME")
    return alias

"""``rlcli train``: drive tinker-cookbook recipes against a Tinker server.

One command per recipe of the registry (``rlcli.recipes.REGISTRY``): its flags come from the
recipe's options dataclass (``recipes/options.py``), and the flow (``recipes/flow.py``) plans,
checks, then runs it. This module only prints: the plan, the lines the flow says, the
progress, the summary.
"""

from __future__ import annotations

import json
import sys

import typer

from rlcli import flags
from rlcli.cli._output import emit, info
from rlcli.recipes import TRAIN, get

app = typer.Typer(
    help="Train: supervised fine-tuning (sl), RL on an environment (rl), preference pairs (dpo), "
    "self-distillation (opsd), agent RL on Harbor tasks in Docker (harbor).",
    no_args_is_help=True,
)


def run_recipe_command(recipe, opts) -> None:
    """Run the flow, printing what it says; then the plan, the start line or the summary."""
    from rlcli.recipes import flow

    outcome = flow.train(recipe, opts, say=info, stdin=sys.stdin)
    if opts.dry_run:
        if opts.json:
            plan = {**outcome.plan_dict(), "options": outcome.options}
            if outcome.estimate is not None:
                plan["estimate"] = outcome.estimate
            emit(plan, as_json=True)
        else:
            emit(outcome.plan_dict(), as_json=False, title="training plan (dry run)")
            shown = {
                k: json.dumps(v) if isinstance(v, dict) else v for k, v in outcome.options.items()
            }
            emit(shown, as_json=False, title="resolved options")
            if outcome.estimate is not None:
                emit(_estimate_rows(outcome.estimate), as_json=False, title="estimate")
    elif outcome.detached is not None:
        result = outcome.detached
        if opts.json:
            emit(result, as_json=True)
            return
        run_id, pid, log = result["id"], result["pid"], result["log"]
        info(f"started {run_id} in the background (pid {pid}); log: {log}")
        info(f"follow: {result['follow']}; stop: {result['cancel']}")
        sys.stdout.write(result["id"] + "\n")
    elif "receipt" in outcome.summary and not opts.json:  # internalize: the scores as a table
        receipt = outcome.summary["receipt"]
        rows = [
            {"document": d["document"], "held out": d["held_out"], **_percent(d)}
            for d in receipt["documents"]
        ]
        emit(rows, as_json=False, title=f"held-out probes answered (control: {receipt['control']})")
        shown = {k: v for k, v in outcome.summary.items() if k != "receipt"}
        emit(shown, as_json=False, title="done")
    else:
        emit(outcome.summary, as_json=opts.json, title="done")


def _percent(scores: dict) -> dict:
    names = ("base", "in_context", "internalized", "control")
    return {n: "-" if scores[n] is None else f"{100 * scores[n]:.0f}%" for n in names}


def _estimate_rows(estimate: dict) -> dict:
    """The dry run's estimate for people: the time, its range and where it came from."""
    from rlcli.runs.timing import human

    if estimate.get("seconds") is None:
        return {"wall time": "unknown", "why": estimate.get("why")}
    rows = {
        "wall time": f"about {human(estimate['seconds'])} "
        f"({human(estimate['low'])} to {human(estimate['high'])})",
        "from": estimate["from"],
        "per step": f"{estimate['per_step_s']:.3g} s after a start-up of "
        f"{human(estimate['startup_s'])}; {estimate['saves']} checkpoint save(s) of "
        f"{estimate['save_s']:g} s",
    }
    if estimate.get("max_minutes"):
        rows["limit"] = estimate["max_minutes"]
    rows["uncertainty"] = estimate["note"]
    return rows


def _register(name: str) -> None:
    recipe = get(name)
    flags.typer_command(
        app, name, recipe.options, lambda opts: run_recipe_command(recipe, opts), help=recipe.help
    )


for _name in TRAIN:
    _register(_name)

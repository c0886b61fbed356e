"""``rlcli runs``: list, show (and follow), plot and cancel training runs
(``rlcli/runs/catalog.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rlcli import recipes
from rlcli.cli._output import JSON, emit, info
from rlcli.recipes.options import resume_command
from rlcli.runs.progress import Follower

app = typer.Typer(help="Training runs: list, show, plot, cancel.", no_args_is_help=True)

RUN = typer.Argument(..., help="Run id (folder name, or a unique prefix) or folder.")


@app.command(
    "list",
    short_help="Every run, newest first.",
    help="Every run in $RLCLI_HOME/runs and every --log-path folder used, newest first: kind, "
    "model, status (starting, running, finished, failed, interrupted, cancelled), steps "
    "done/total, last loss / reward / KL, start, duration.",
)
def list_(as_json: bool = JSON) -> None:
    from rlcli.runs import catalog

    states = catalog.list_runs()
    if as_json:
        emit(states, as_json=True)
    elif not states:
        info(f"no runs yet in {catalog.runs_root()} (rlcli train sl|rl|opsd|harbor starts one)")
    else:
        typer.echo(_plain_table([catalog.row(s) for s in states]))


def _plain_table(rows: list[dict]) -> str:
    """Aligned columns, nothing cut or wrapped, whatever the terminal's width (pipes, grep)."""
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.upper().ljust(widths[k]) for k in keys).rstrip()]
    lines += ["  ".join(str(r[k]).ljust(widths[k]) for k in keys).rstrip() for r in rows]
    return "\n".join(lines)


@app.command(
    "show",
    short_help="One run in full; -f follows a running one.",
    help="A run's state, folder and logs, last metrics, checkpoints (tinker:// paths), resolved "
    "config, and the error if it failed. -f follows a running run (e.g. a detached one) until it "
    "ends and exits with its outcome (0 finished, 1 failed, 4 cancelled, 130/143/129 interrupted).",
)
def show(
    run: str = RUN,
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Follow a running run until it ends; exit with its outcome."
    ),
    as_json: bool = JSON,
) -> None:
    from rlcli.runs import catalog

    run_dir = catalog.resolve(run)
    if follow:
        _follow(run_dir)
    shown = catalog.show(run_dir)
    if as_json:
        emit(shown, as_json=True)
    else:
        _print_show(shown)
    if follow and shown["status"] != "finished":
        code = shown["exit_code"] or catalog.EXIT_OF.get(shown["status"], 1)
        raise typer.Exit(code)


def _follow(run_dir: Path) -> None:
    """Step lines and phases on stderr until the run is no longer running."""
    import time

    from rlcli.runs import catalog

    now = catalog.state(run_dir)
    try:  # each recipe names what its progress lines show
        recipe = recipes.get(now["kind"])
        show, tokens_key = recipe.show, recipe.tokens_key
    except (KeyError, ImportError):
        show, tokens_key = {k: label for k, label in catalog.METRICS.get(now["kind"] or "", ())}, ""
    if now["status"] not in catalog.LIVE:
        info(f"run {now['id']} is not running ({now['status']})")
        return
    info(
        f"following {now['id']} (step {now['steps_done']}/{now['total_steps']}); "
        "Ctrl-C stops following, not the run"
    )
    follower = Follower(run_dir, now["total_steps"] or 0, show, info, tokens_key)
    try:
        while catalog.state(run_dir)["status"] in catalog.LIVE:
            follower.poll()
            time.sleep(0.5)
        follower.poll()
    except KeyboardInterrupt:
        follower.close()
        raise typer.Exit(130) from None
    follower.close()
    final = catalog.state(run_dir)
    info(f"run {final['id']} {final['status']}" + (f": {final['error']}" if final["error"] else ""))


def _print_show(shown: dict) -> None:
    """Plain sections (tinker:// paths are never cut, whatever the terminal's width)."""
    from rlcli.runs import catalog

    head = catalog.row(shown)
    head["run_dir"] = shown["run_dir"]
    if shown["error"]:
        head["error"] = shown["error"]
    for name, path in shown["logs"].items():
        head[f"log ({name})"] = path
    typer.echo(_plain_pairs(head))
    if shown["last_metrics"]:
        last = {k: v for k, v in shown["last_metrics"].items() if not k.startswith("time/")}
        typer.echo("\nlast metrics\n" + _plain_pairs(last, indent="  "))
    earlier = {
        f"{label} (step {m['step']})": m["value"]
        for label, m in shown.get("last_measured", {}).items()
        if m["step"] != (shown["last_metrics"] or {}).get("step")
    }
    if earlier:
        typer.echo("\nlast measured\n" + _plain_pairs(earlier, indent="  "))
    if shown["checkpoints"]:
        table = [
            {
                "name": c.get("name"),
                "epoch": c.get("epoch", ""),
                "batch": c.get("batch", ""),
                "state_path": c.get("state_path", ""),
                "sampler_path": c.get("sampler_path", ""),
            }
            for c in shown["checkpoints"]
        ]
        typer.echo("\ncheckpoints\n" + _plain_table(table))
    if shown["config"]:
        config = {
            k: json.dumps(v) if isinstance(v, dict) else v for k, v in shown["config"].items()
        }
        typer.echo("\nconfig\n" + _plain_pairs(config, indent="  "))


def _plain_pairs(pairs: dict, indent: str = "") -> str:
    width = max(len(str(k)) for k in pairs)
    lines = [f"{indent}{str(k).ljust(width)}  {'' if v is None else v}" for k, v in pairs.items()]
    return "\n".join(line.rstrip() for line in lines)


@app.command(
    "plot",
    short_help="Loss / reward / accuracy / KL curves as a PNG.",
    help="Loss (sl), reward and accuracy (rl), teacher KL (opsd) per step as one PNG: a panel "
    "per metric, several runs overlaid with a legend. --json lists the panels and series drawn.",
)
def plot(
    run: list[str] = typer.Argument(..., help="Run ids or folders; several are overlaid."),
    out: Path | None = typer.Option(
        None, "--output", "-o", help="PNG to write (default: curves.png in the first run's folder)."
    ),
    as_json: bool = JSON,
) -> None:
    from rlcli.runs import catalog

    result = catalog.plot([catalog.resolve(r) for r in run], out)
    if as_json:
        emit(result, as_json=True)
        return
    for panel in result["panels"]:
        drawn = ", ".join(f"{s['run']} ({s['points']} steps)" for s in panel["series"])
        info(f"{panel['label']}: {drawn}")
    typer.echo(result["path"])


@app.command(
    "cancel",
    short_help="Stop a run cleanly, with a final checkpoint.",
    help="Stop a running run cleanly: at the end of its current step it saves a checkpoint (state "
    "and sampler weights), is marked cancelled and its rlcli exits 4. Waits for that and prints "
    "the checkpoint and the resume command.",
)
def cancel(
    run: str = RUN,
    wait: float = typer.Option(
        120.0,
        "--wait",
        help="Seconds to wait for the run to stop (it stops after its step).",
        min=0,
    ),
    force: bool = typer.Option(
        False, "--force", help="Stop it now with SIGTERM: no final checkpoint."
    ),
    as_json: bool = JSON,
) -> None:
    from rlcli.runs import catalog

    run_dir = catalog.resolve(run)
    result = catalog.cancel(run_dir, wait=wait, force=force, report=info)
    kind = catalog.state(run_dir)["kind"] or "sl"
    command = f"rlcli train {kind}" if kind != "internalize" else "rlcli internalize"
    result["resume"] = resume_command(command, str(run_dir))
    if as_json:
        emit(result, as_json=True)
        return
    checkpoint = result["checkpoint"] or {}
    shown = {
        "run": result["id"],
        "status": result["status"],
        "steps": f"{result['steps_done']}/{result['total_steps']}",
        "state_path": checkpoint.get("state_path", "(none)"),
        "sampler_path": checkpoint.get("sampler_path", "(none)"),
        "resume": result["resume"],
    }
    typer.echo(_plain_pairs(shown))

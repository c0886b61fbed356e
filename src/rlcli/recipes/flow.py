"""The one flow every ``rlcli train`` command follows, for the CLI and the Python API alike.

Check everything that needs no server, then everything the server can tell, and only then
lock and write the run folder and start the recipe (``runner.run_recipe``). Nothing here
prints: lines for the user go to ``say``, the running recipe's progress to ``progress``
(a ``progress.Reporter``; None: the CLI's display over ``say``), and every refusal or
failure is an exception (``RlcliError``; ``RunFailed`` for a run that started).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlcli import flags
from rlcli.client import endpoint
from rlcli.compat import renderer_choice
from rlcli.errors import RlcliError
from rlcli.launch.pids import start_ticks
from rlcli.models.gguf import local_model
from rlcli.recipes import options, preflight
from rlcli.recipes.base import Plan, Recipe
from rlcli.recipes.estimate import estimate
from rlcli.runs import folder, runner
from rlcli.runs.folder import DETACHED_LOG


@dataclass
class Outcome:
    """What ``train`` did: the plan and the options as the run uses them (saved as its
    config.yaml), and the run's ``summary`` (None: a dry run, with its ``estimate``, or
    ``detached``, what a run started in the background can be followed with)."""

    plan: Plan
    options: dict[str, Any]
    summary: dict | None = None
    detached: dict | None = None
    estimate: dict | None = None  # a dry run's estimate of the wall time (recipes/estimate.py)

    @property
    def run_dir(self) -> str:
        return self.plan.run_dir

    def plan_dict(self) -> dict:
        return asdict(self.plan)


def train(
    recipe: Recipe,
    opts,
    say: Callable[[str], None],
    progress=None,
    stdin=None,
) -> Outcome:
    """Plan, check, then run ``recipe`` with ``opts`` (a dry run stops after the plan)."""
    with recipe.around(opts, say) as opts:
        return _train(recipe, opts, say, progress, stdin)


def _train(recipe: Recipe, opts, say, progress, stdin) -> Outcome:
    began = time.monotonic()
    if opts.wandb_project or opts.wandb_name:
        require_wandb(opts)
    options.lora_switches(opts.lora_targets)  # a bad list is one line, before anything

    if opts.model:  # a .gguf becomes the folder it converts to (what the server serves)
        preflight.check_model_arg(opts.model)
        opts.model = local_model(opts.model, report=say)
    teacher = getattr(opts, "teacher", None)
    if teacher and not teacher.startswith("tinker://"):  # opsd's --teacher, the same way
        opts.teacher = local_model(teacher, report=say)
    url, source = endpoint.resolve_base_url(opts.base_url)

    def hosted() -> None:  # a few ms, where the hub lookup can retry for a minute offline
        endpoint.check_server(url, model=opts.model, source=source)
        preflight.Server(url).check_model(opts.model)

    reads_stdin = getattr(opts, "dataset", None) == "-" or "-" in (
        getattr(opts, "documents", None) or ()
    )  # internalize's DOCUMENT -
    if not reads_stdin:
        stdin = None

    with renderer_choice.before_hub_lookup(None if opts.dry_run else hosted):
        plan, data = recipe.prepare(opts, stdin=stdin, dry_run=opts.dry_run)
    preflight.check_run_dir(Path(plan.run_dir))
    run_opts = recipe.resolved(opts, plan, url)
    options.check_same_run(Path(plan.run_dir), run_opts, recipe.command)
    say(f"renderer: {plan.renderer} ({plan.renderer_source})")
    outcome = Outcome(plan, flags.saved(run_opts))
    if opts.dry_run:
        if not opts.no_estimate:
            prepare_s = time.monotonic() - began
            outcome.estimate = estimate(recipe, run_opts, plan, data, url, source, prepare_s, say)
        return outcome
    say(endpoint.describe(url, source))
    served_by = check_server(recipe, run_opts, plan, url, source, say)
    for note in recipe.notes(opts, served_by):
        say(note)

    runner.lock_run_dir(Path(plan.run_dir))  # before anything is written into the folder
    recipe.commit(opts, plan, data)  # the options as given (sl: was it stdin?)
    if opts.detach:
        outcome.detached = detach(recipe, run_opts, plan)
        return outcome
    run_dir = Path(plan.run_dir)
    what = recipe.describe(plan, served_by)
    say(f"{'resuming' if plan.resuming else 'training'} in {run_dir}: {what}")
    runner.write_spec(run_dir, recipe.spec(run_opts, plan))
    options.write_config(run_dir, run_opts, recipe.command)
    outcome.summary = runner.run_recipe(
        run_dir,
        total_steps=plan.steps,
        show=recipe.show,
        resume_hint=recipe.resume_hint(run_opts, plan),
        report=progress or say,
        tokens_key=recipe.tokens_key,
        base_url=run_opts.base_url,
        max_minutes=run_opts.max_minutes,
    )
    return outcome


def check_server(recipe: Recipe, opts, plan, url: str, source: str, say) -> str:
    """Everything the server can tell before the run folder exists; returns its backend."""
    endpoint.check_server(url, model=opts.model, source=source)
    server = preflight.Server(url)
    server.check_model(opts.model)
    server.check_lora_rank(opts.lora_rank)
    server.check_lora_alpha(opts.lora_alpha)
    return recipe.check_server(server, opts, plan, say)


def require_wandb(opts) -> None:
    """W&B needs the package, and the cookbook logs to it only when ``WANDB_API_KEY`` is set
    (it skips W&B with a warning the user never sees otherwise). Offline runs need no key, so
    one is filled in for them (the recipe child inherits this environment)."""
    import importlib.util
    import os

    if not opts.wandb_project:
        raise RlcliError("--wandb-name: name the project too (--wandb-project)")
    if importlib.util.find_spec("wandb") is None:
        raise RlcliError(
            "--wandb-project/--wandb-name need the wandb package: pip install 'rlcli[wandb]'"
        )
    if os.environ.get("WANDB_API_KEY"):
        return
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        os.environ["WANDB_API_KEY"] = "0" * 40  # never sent: offline runs stay local
        return
    raise RlcliError(
        "--wandb-project: set WANDB_API_KEY (the cookbook logs to W&B only with it), "
        "or WANDB_MODE=offline to keep the W&B run on this machine"
    )


def detach(recipe: Recipe, opts, plan) -> dict:
    """Every check has passed: run ``<command> --config RUN/config.yaml --log-path RUN`` in the
    background, in its own session (a closed terminal does not stop it), output to
    ``detached.log``. It is an ordinary run (same flow, record and lock: this process hands the
    locked descriptor over, so the folder is never unlocked in between). Stdin data was kept in
    the folder by ``commit`` and ``config.yaml`` names that copy. Returns how to follow it."""
    import os
    import subprocess

    run_dir = Path(plan.run_dir).resolve()
    config = options.write_config(run_dir, opts, recipe.command)
    log = run_dir / DETACHED_LOG
    lock_fd = runner.lock_run_dir(run_dir)
    argv = [sys.executable, "-m", "rlcli.cli.main", *recipe.command.split()[1:]]
    argv += ["--config", str(config), "--log-path", str(run_dir)]
    if opts.max_minutes is not None:  # not a setting of the run: of this command
        argv += ["--max-minutes", repr(opts.max_minutes)]
    env = {**os.environ, runner.INHERITED_LOCK_ENV: f"{lock_fd}:{run_dir}"}
    with log.open("a") as out:
        out.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv[1:])}\n")
        out.flush()
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=(lock_fd,),
        )
    before = folder.read_record(run_dir) or {}
    if not (before.get("pid") == child.pid and before.get("status") == "running"):
        folder.write_record(
            run_dir,
            {
                "id": run_dir.name,
                "run_dir": str(run_dir),
                "kind": recipe.name,
                "model": opts.model,
                "status": "starting",
                "pid": child.pid,
                "pid_start": start_ticks(child.pid),
                "started": time.time(),
                "total_steps": plan.steps,
                "base_url": opts.base_url,
                "detached_log": str(log),
            },
        )
    runner.register_run(run_dir)
    runner.release_run_dir(run_dir)  # the child holds the lock now
    return {
        "id": run_dir.name,
        "run_dir": str(run_dir),
        "log": str(log),
        "pid": child.pid,
        "follow": f"rlcli runs show {run_dir.name} -f",
        "cancel": f"rlcli runs cancel {run_dir.name}",
    }

"""``rlcli train``: drive tinker-cookbook recipes against a Tinker server.

Each command is its options dataclass (``recipes/options.py`` builds the flags from it) and a
recipe module with the same few functions (``prepare``, ``check_server``, ``commit``,
``resolved``, ``spec``, ``describe``, ``resume_hint``); ``_train`` is the one flow they share:
check everything that needs no server, then everything the server can tell, and only then
create the run folder and start the recipe.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import typer

from rlcli.cli._output import emit, info
from rlcli.recipes import dpo, harbor, opsd, options, preflight, rl, sl

app = typer.Typer(
    help="Train: supervised fine-tuning (sl), RL on an environment (rl), preference pairs (dpo), "
    "self-distillation (opsd), agent RL on Harbor tasks in Docker (harbor).",
    no_args_is_help=True,
)


def _train(recipe, opts) -> None:
    """Plan, check, then run ``recipe`` with ``opts``; prints the plan or the summary."""
    from rlcli.client import endpoint

    if opts.wandb_project or opts.wandb_name:
        _require_wandb(opts)
    from rlcli.models.gguf import local_model

    if opts.model:  # a .gguf becomes the folder it converts to (what the server serves)
        preflight.check_model_arg(opts.model)
        opts.model = local_model(opts.model, report=info)
    teacher = getattr(opts, "teacher", None)
    if teacher and not teacher.startswith("tinker://"):  # opsd's --teacher, the same way
        opts.teacher = local_model(teacher, report=info)
    url, source = endpoint.resolve_base_url(opts.base_url)

    def hosted() -> None:  # a few ms, where the hub lookup can retry for a minute offline
        endpoint.check_server(url, model=opts.model, source=source)
        preflight.Server(url).check_model(opts.model)

    stdin = sys.stdin if getattr(opts, "dataset", None) == "-" else None
    from rlcli.compat import renderer_choice

    with renderer_choice.before_hub_lookup(None if opts.dry_run else hosted):
        plan, data = recipe.prepare(opts, stdin=stdin, dry_run=opts.dry_run)
    preflight.check_run_dir(Path(plan.run_dir))
    run_opts = recipe.resolved(opts, plan, url)
    options.check_same_run(Path(plan.run_dir), run_opts, recipe.COMMAND)
    info(f"renderer: {plan.renderer} ({plan.renderer_source})")
    if opts.dry_run:
        resolved = options.saved(run_opts)
        if opts.json:
            emit({**asdict(plan), "options": resolved}, as_json=True)
        else:
            emit(asdict(plan), as_json=False, title="training plan (dry run)")
            shown = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in resolved.items()}
            emit(shown, as_json=False, title="resolved options")
        return
    info(endpoint.describe(url, source))
    served_by = _check_server(recipe, run_opts, plan, url, source)
    if getattr(recipe, "gspo_note_applies", None) and recipe.gspo_note_applies(opts, served_by):
        info(recipe.GSPO_NOTE)
    from rlcli.runs import runner

    runner.lock_run_dir(Path(plan.run_dir))  # before anything is written into the folder
    recipe.commit(opts, plan, data)  # the options as given (sl: was it stdin?)
    if opts.detach:
        _detach(recipe, run_opts, plan, opts.json)
        return
    _run(recipe, run_opts, plan, recipe.describe(plan, served_by), opts.json)


def _check_server(recipe, opts, plan, url: str, source: str) -> str:
    """Everything the server can tell before the run folder exists; returns its backend."""
    from rlcli.client import endpoint

    endpoint.check_server(url, model=opts.model, source=source)
    server = preflight.Server(url)
    server.check_model(opts.model)
    server.check_lora_rank(opts.lora_rank)
    server.check_lora_alpha(opts.lora_alpha)
    return recipe.check_server(server, opts, plan)


def _require_wandb(opts) -> None:
    """W&B needs the package, and the cookbook logs to it only when ``WANDB_API_KEY`` is set
    (it skips W&B with a warning the user never sees otherwise). Offline runs need no key, so
    one is filled in for them (the recipe child inherits this environment)."""
    import importlib.util
    import os

    from rlcli.errors import RlcliError

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


def _run(recipe, opts, plan, what: str, as_json: bool) -> None:
    """Save the spec and config.yaml, run the recipe with progress, print its summary."""
    from rlcli.runs import runner

    run_dir = Path(plan.run_dir)
    info(f"{'resuming' if plan.resuming else 'training'} in {run_dir}: {what}")
    runner.write_spec(run_dir, recipe.spec(opts, plan))
    options.write_config(run_dir, opts, recipe.COMMAND)
    summary = runner.run_recipe(
        run_dir,
        total_steps=plan.steps,
        show=recipe.SHOW,
        resume_hint=recipe.resume_hint(opts, plan),
        report=info,
        tokens_key=recipe.TOKENS_KEY,
        base_url=opts.base_url,
    )
    emit(summary, as_json=as_json, title="done")


def _detach(recipe, opts, plan, as_json: bool) -> None:
    """Every check has passed: run ``<command> --config RUN/config.yaml --log-path RUN`` in the
    background, in its own session (a closed terminal does not stop it), output to
    ``detached.log``. It is an ordinary run (same flow, record and lock: this process hands the
    locked descriptor over, so the folder is never unlocked in between). Stdin data was kept in
    the folder by ``commit`` and ``config.yaml`` names that copy."""
    import os
    import subprocess
    import time

    from rlcli.launch.process import start_ticks
    from rlcli.runs import runner
    from rlcli.runs.catalog import DETACHED_LOG

    run_dir = Path(plan.run_dir).resolve()
    config = options.write_config(run_dir, opts, recipe.COMMAND)
    log = run_dir / DETACHED_LOG
    lock_fd = runner.lock_run_dir(run_dir)
    argv = [sys.executable, "-m", "rlcli.cli.main", *recipe.COMMAND.split()[1:]]
    argv += ["--config", str(config), "--log-path", str(run_dir)]
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
    before = runner.read_record(run_dir) or {}
    if not (before.get("pid") == child.pid and before.get("status") == "running"):
        runner.write_record(
            run_dir,
            {
                "id": run_dir.name,
                "run_dir": str(run_dir),
                "kind": recipe.COMMAND.split()[-1],
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
    result = {
        "id": run_dir.name,
        "run_dir": str(run_dir),
        "log": str(log),
        "pid": child.pid,
        "follow": f"rlcli runs show {run_dir.name} -f",
        "cancel": f"rlcli runs cancel {run_dir.name}",
    }
    if as_json:
        emit(result, as_json=True)
        return
    info(f"started {run_dir.name} in the background (pid {child.pid}); log: {log}")
    info(f"follow: {result['follow']}; stop: {result['cancel']}")
    sys.stdout.write(run_dir.name + "\n")


options.typer_command(
    app,
    "sl",
    sl.SLOptions,
    lambda opts: _train(sl, opts),
    help="Supervised fine-tuning on chat conversations, with the cookbook's supervised recipe.",
)
options.typer_command(
    app,
    "rl",
    rl.RLOptions,
    lambda opts: _train(rl, opts),
    help="RL on an environment (gsm8k, arithmetic, niah, your own JSONL) with the cookbook's "
    "RL recipe; every loss, fused on the server.",
)
options.typer_command(
    app,
    "dpo",
    dpo.DPOOptions,
    lambda opts: _train(dpo, opts),
    help="Preference training (DPO) on chosen/rejected pairs, with the cookbook's DPO recipe; "
    "the reference is the base model.",
)
options.typer_command(
    app,
    "opsd",
    opsd.OpsdOptions,
    lambda opts: _train(opsd, opts),
    help="On-policy self-distillation from a prompts file: a teacher's reverse KL, no reward.",
)
options.typer_command(
    app,
    "harbor",
    harbor.HarborOptions,
    lambda opts: harbor.train(_train, opts),
    help="Agent RL on Harbor tasks (a container, an instruction, a test script whose verdict "
    "is the reward) in containers on the local Docker daemon, with the cookbook's harbor_rl.",
)

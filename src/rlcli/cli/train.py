"""``rlcli train``: drive tinker-cookbook recipes against a Tinker server."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path

import typer

from rlcli.cli._output import emit, info

app = typer.Typer(
    help="Train: supervised fine-tuning (sl), RL on GSM8K (rl).", no_args_is_help=True
)


def _base_url(flag: str | None) -> str:
    return flag or os.environ.get("TINKER_BASE_URL") or "http://localhost:8000"


def _run(recipe, opts, plan, what: str, show: dict[str, str], as_json: bool, tokens_key: str):
    """Save the spec, run the recipe with progress, print its summary."""
    from rlcli.recipes import runner

    run_dir = Path(plan.run_dir)
    info(f"{'resuming' if plan.resuming else 'training'} in {run_dir}: {what}")
    runner.write_spec(run_dir, recipe.spec(opts, plan))
    summary = runner.run_recipe(
        run_dir,
        total_steps=plan.steps,
        show=show,
        resume_hint=recipe.resume_hint(opts, plan),
        report=info,
        tokens_key=tokens_key,
    )
    emit(summary, as_json=as_json, title="done")


@app.command("sl")
def sl(
    dataset: str = typer.Option(..., help="Chat JSONL ({'messages': [...]}) or - for stdin."),
    model: str = typer.Option(..., help="Base model: hub id or local folder."),
    base_url: str = typer.Option(
        None, help="Tinker server (default: $TINKER_BASE_URL or http://localhost:8000)."
    ),
    renderer: str = typer.Option(None, help="Chat renderer (default: recommended for the model)."),
    batch_size: int = typer.Option(8, help="Conversations per step."),
    lr: float = typer.Option(1e-4, help="Peak learning rate (linear decay)."),
    max_length: int = typer.Option(2048, help="Truncate conversations to this many tokens."),
    epochs: int = typer.Option(1, help="Passes over the data."),
    lora_rank: int = typer.Option(32, help="LoRA rank."),
    save_every: int = typer.Option(20, help="Checkpoint every N steps (0: only at the end)."),
    test_size: float = typer.Option(0.0, help="Fraction of conversations held out (0-1)."),
    max_steps: int = typer.Option(None, help="Stop after this many steps."),
    log_path: str = typer.Option(
        None, help="Run folder (default: $RLCLI_HOME/runs/sl-<time>); reuse it to resume."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; contact no server."),
    as_json: bool = typer.Option(False, "--json", help="Print results as JSON."),
) -> None:
    """Supervised fine-tuning on chat conversations, with the cookbook's supervised recipe."""
    from rlcli.recipes import runner
    from rlcli.recipes import sl as recipe

    opts = recipe.SLOptions(
        dataset=dataset, model=model, base_url=_base_url(base_url), renderer=renderer,
        batch_size=batch_size, lr=lr, max_length=max_length, epochs=epochs,
        lora_rank=lora_rank, save_every=save_every, test_size=test_size,
        log_path=log_path, max_steps=max_steps,
    )  # fmt: skip
    plan = recipe.prepare(opts, stdin=sys.stdin if dataset == "-" else None, dry_run=dry_run)
    if not renderer:
        info(f"renderer: {plan.renderer} ({plan.renderer_source})")
    if dry_run:
        emit(asdict(plan), as_json=as_json, title="training plan (dry run)")
        return
    runner.check_server(opts.base_url, model)
    held_out = f", {plan.held_out} held out" if plan.held_out else ""
    what = f"{plan.train_examples} conversations, {plan.steps} steps{held_out}"
    _run(recipe, opts, plan, what, {"train_mean_nll": "loss"}, as_json, "num_tokens")


@app.command("rl")
def rl(
    model: str = typer.Option(..., help="Base model: hub id or local folder."),
    base_url: str = typer.Option(
        None, help="Tinker server (default: $TINKER_BASE_URL or http://localhost:8000)."
    ),
    loss: str = typer.Option(
        "importance_sampling",
        help="importance_sampling | ppo | cispo | dro | gspo | dppo | ppo_critic.",
    ),
    loss_config: str = typer.Option(None, help='Loss settings as JSON, e.g. {"beta": 0.1}.'),
    backend: str = typer.Option(
        None, help="Server backend, for the loss guard: torch | jax | fsdp | megatron."
    ),
    dataset: str = typer.Option("gsm8k", help="Problems to train on (gsm8k)."),
    gsm8k_dir: str = typer.Option(
        None, help="Folder with GSM8K train.jsonl/test.jsonl (env: RLCLI_GSM8K_DIR; else the hub)."
    ),
    renderer: str = typer.Option(None, help="Chat renderer (default: recommended for the model)."),
    batch_size: int = typer.Option(64, help="Problems per step."),
    group_size: int = typer.Option(8, help="Rollouts per problem."),
    lr: float = typer.Option(4e-5, help="Learning rate."),
    max_tokens: int = typer.Option(256, help="Longest sampled answer."),
    lora_rank: int = typer.Option(32, help="LoRA rank."),
    save_every: int = typer.Option(20, help="Checkpoint every N steps (0: only at the end)."),
    eval_every: int = typer.Option(0, help="GSM8K test accuracy every N steps (0: never)."),
    eval_size: int = typer.Option(200, help="Test problems per evaluation."),
    max_steps: int = typer.Option(None, help="Stop after this many steps."),
    log_path: str = typer.Option(
        None, help="Run folder (default: $RLCLI_HOME/runs/rl-<time>); reuse it to resume."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; contact no server."),
    as_json: bool = typer.Option(False, "--json", help="Print results as JSON."),
) -> None:
    """RL on GSM8K with the cookbook's RL recipe; every loss, fused on the server."""
    from rlcli.recipes import loss_guard, runner
    from rlcli.recipes import rl as recipe

    opts = recipe.RLOptions(
        model=model, base_url=_base_url(base_url), loss=loss, loss_config=loss_config,
        backend=backend, dataset=dataset, gsm8k_dir=gsm8k_dir, renderer=renderer,
        batch_size=batch_size, group_size=group_size, lr=lr, max_tokens=max_tokens,
        lora_rank=lora_rank, save_every=save_every, eval_every=eval_every,
        eval_size=eval_size, max_steps=max_steps, log_path=log_path,
    )  # fmt: skip
    plan = recipe.prepare(opts)
    if not renderer:
        info(f"renderer: {plan.renderer} ({plan.renderer_source})")
    if loss == "gspo":
        info(recipe.GSPO_NOTE)
    if dry_run:
        emit(asdict(plan), as_json=as_json, title="training plan (dry run)")
        return
    if plan.data_source.startswith("hub:"):  # fail now, not inside the recipe, if offline
        from rlcli.data import gsm8k

        gsm8k.load_rows(None, "test")
    runner.check_server(opts.base_url, model)
    served_by = loss_guard.check_server(opts.base_url, loss, backend, model)
    what = f"loss {loss} ({served_by} backend), {plan.steps} steps of "
    what += f"{plan.rollouts_per_step} rollouts"
    show = {recipe.REWARD: "reward", recipe.ACCURACY: "acc"}
    _run(recipe, opts, plan, what, show, as_json, recipe.SAMPLED_TOKENS)

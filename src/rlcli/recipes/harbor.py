"""Agent RL on Harbor tasks in local Docker containers: rlcli's layer over the cookbook's
``recipes/harbor_rl`` (``HarborDatasetBuilder``: the multi-turn bash-tool episode, turn limit,
context overflow) with rlcli's Docker sandbox (``rlcli.harbor.docker``) and verifier plugged in.

``prepare`` resolves ``--dataset`` and validates every task folder (no server, no daemon: all
a ``--dry-run`` does); ``check_server`` checks the server, then the Docker daemon, and builds
the task images (a broken Dockerfile is one line naming the task) before the run folder is
made; ``run_in_child`` runs the cookbook's RL loop. Containers carry the run's label
(``run_id``) and are removed by the recipe child on every way out it sees, and by the parent
``rlcli`` after the child is gone (``train``), so a SIGKILLed child leaves none either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from rlcli.errors import RlcliError
from rlcli.recipes.options import PolicyOptions, TrainOptions, option, resume_command, retune, saved
from rlcli.recipes.rl import check_policy_flags, policy_config, policy_summary, seed_sampling
from rlcli.runs.runner import default_run_dir

GRADER_TIMEOUT_S = 60  # a task's [verifier] timeout_sec raises it
MAX_TRAJECTORY_TOKENS = 32 * 1024  # the cookbook's default: past it the episode ends


@dataclass(kw_only=True)
class HarborOptions(PolicyOptions):
    dataset: str = option(
        "terminal-bench@2.0",
        "Tasks: a folder of Harbor task folders (e.g. examples/harbor-tasks), or name@version "
        "from the Harbor cache (~/.cache/harbor/tasks; downloaded with uvx harbor when missing).",
    )
    sandbox: str = option(
        "docker",
        "Where each rollout's container runs: the local Docker daemon, or Modal (needs the "
        "modal package and credentials).",
        choices=("docker", "modal"),
    )
    task_filter: str | None = option(
        None, "Only tasks whose folder name matches: a name or glob (comma-separated: several)."
    )
    max_tasks: int | None = option(None, "Use at most this many tasks (after the filter).", min=1)
    group_size: int = retune(PolicyOptions, "group_size", 4)
    groups_per_batch: int = option(4, "Tasks per step (each with --group-size rollouts).", min=1)
    lr: float = retune(TrainOptions, "lr", 1e-5)
    max_tokens: int = retune(PolicyOptions, "max_tokens", 4096)
    max_turns: int = option(10, "Most model turns (bash tool calls) per episode.", min=1)
    save_every: int = retune(TrainOptions, "save_every", 5)
    env_timeout: int = option(
        3600, "Seconds a rollout's container may live (it is removed after).", min=1
    )
    command_timeout: int = option(
        120, "Seconds one bash command may run before it is killed (the model is told).", min=1
    )


@dataclass
class HarborPlan:
    run_dir: str
    loss: str
    loss_config: dict | None
    dataset: str
    data_source: str
    tasks: list[str]
    groups_per_step: int
    rollouts_per_step: int
    steps: int
    sandbox: str
    renderer: str
    renderer_source: str
    resuming: bool


def run_dir_of(opts: HarborOptions) -> Path:
    return Path(opts.log_path).expanduser() if opts.log_path else default_run_dir("harbor")


def run_id(run_dir: str | Path) -> str:
    """The label value of a run's containers: a hash of its folder (same folder, same id, so a
    resume also removes what a killed attempt left)."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def load_tasks(dataset: str, task_filter: str | None, max_tasks: int | None, download=True):
    from rlcli.harbor import tasks

    folder, source = tasks.resolve_dataset(dataset, download=download)
    return folder, source, tasks.load_tasks(folder, task_filter, max_tasks)


def check_modal() -> None:
    import importlib.util
    import os

    if importlib.util.find_spec("modal") is None:
        raise RlcliError(
            "--sandbox modal: the modal package is not installed (pip install 'rlcli[modal]')"
        )
    has_env = os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET")
    if not has_env and not (Path.home() / ".modal.toml").is_file():
        raise RlcliError(
            "--sandbox modal: no Modal credentials (run `modal token new`, or set "
            "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET); or use --sandbox docker"
        )


def prepare(opts: HarborOptions, stdin=None, dry_run: bool = False) -> tuple[HarborPlan, None]:
    """Check flags, model, renderer and every task folder, and count the steps; no server, no
    sandbox, no writes."""
    from rlcli.compat.renderer_choice import resolve_renderer

    config = check_policy_flags(opts)
    if opts.sandbox == "modal":
        check_modal()
    folder, source, found = load_tasks(opts.dataset, opts.task_filter, opts.max_tasks)
    renderer, renderer_source, _ = resolve_renderer(opts.model, opts.renderer)
    run_dir = run_dir_of(opts)
    groups = min(opts.groups_per_batch, len(found))
    steps = math.ceil(len(found) / opts.groups_per_batch)
    if opts.max_steps is not None:
        steps = min(steps, opts.max_steps)
    plan = HarborPlan(
        run_dir=str(run_dir),
        loss=opts.loss,
        loss_config=config,
        dataset=opts.dataset if source.startswith("Harbor cache") else str(folder),
        data_source=source,
        tasks=[t.name for t in found],
        groups_per_step=groups,
        rollouts_per_step=groups * opts.group_size,
        steps=steps,
        sandbox=opts.sandbox,
        renderer=renderer,
        renderer_source=renderer_source,
        resuming=(run_dir / "checkpoints.jsonl").exists(),
    )
    return plan, None


def check_server(server, opts: HarborOptions, plan: HarborPlan) -> str:
    """Before any rollout: the server's checks and the loss guard, then the sandbox: the Docker
    daemon answers and every task's image is there (built now when missing)."""
    from rlcli.cli._output import info
    from rlcli.recipes import loss_guard

    server.check_max_tokens(opts.max_tokens)
    server.check_checkpoint(opts.init_checkpoint, "--init-checkpoint", "training")
    server.check_checkpoint(opts.kl_reference, "--kl-reference", "sampler")
    served_by = loss_guard.check_server(
        server.base_url, opts.loss, opts.backend, opts.model, plan.loss_config
    )
    server.check_loss_config_values(opts.model, opts.loss, plan.loss_config)
    loss_guard.say_skyrl_note(served_by, opts.loss, plan.loss_config)
    if plan.sandbox == "docker":
        from rlcli.harbor import docker

        version = docker.check_daemon()
        _, _, found = load_tasks(plan.dataset, opts.task_filter, opts.max_tasks, download=False)
        built = []
        for task in found:
            if docker.needs_build(task):
                info(f"building the image of task {task.name} ({task.environment})")
            tag, new = docker.ensure_image(task)
            if new:
                built.append(tag)
        info(
            f"docker {version} at {docker.where()}: {len(found)} task images ready"
            + (f" ({len(built)} built now)" if built else "")
        )
    return served_by


def resolved(opts: HarborOptions, plan: HarborPlan, base_url: str) -> HarborOptions:
    """The options a run keeps: the server, renderer and run folder found, a local dataset as
    an absolute path (so ``--config`` of the run trains on the same tasks)."""
    return dataclasses.replace(
        opts, base_url=base_url, renderer=plan.renderer, dataset=plan.dataset,
        log_path=plan.run_dir,
    )  # fmt: skip


def commit(opts: HarborOptions, plan: HarborPlan, data) -> None:
    """Nothing to write before the run (the tasks stay where they are)."""


def spec(opts: HarborOptions, plan: HarborPlan) -> dict:
    return {"recipe": "harbor", "options": saved(opts), "plan": asdict(plan)}


def train(train_flow, opts: HarborOptions) -> None:
    """``train_flow(this module, opts)`` (``cli/train.py``'s ``_train``), then remove every
    container of the run, whatever way it ended (the recipe child's own cleanup cannot run
    when it is SIGKILLed). A dry run makes none; a detached run cleans up in its own process."""
    import sys

    if opts.dry_run or opts.detach or opts.sandbox != "docker":
        train_flow(sys.modules[__name__], opts)
        return
    run_dir = run_dir_of(opts)
    opts = dataclasses.replace(opts, log_path=str(run_dir))
    try:
        train_flow(sys.modules[__name__], opts)
    finally:
        from rlcli.harbor import docker
        from rlcli.runs.runner import SPEC

        # Only once a recipe may have started (a refused run made no container).
        left = docker.remove_run_containers(run_id(run_dir)) if (run_dir / SPEC).exists() else 0
        if left:
            from rlcli.cli._output import info

            info(f"removed {left} container(s) the run left behind")


# ---- in the recipe child --------------------------------------------------------------------


def cookbook_config(spec: dict):

    from rlcli.compat.harbor_hooks import import_harbor_env
    from rlcli.harbor.docker import STATS_FILE, DockerSandboxFactory

    harbor_env = import_harbor_env()  # modal need not be installed
    HarborDatasetBuilder, HarborTask = harbor_env.HarborDatasetBuilder, harbor_env.HarborTask

    opts, plan = spec["options"], spec["plan"]
    _, _, found = load_tasks(plan["dataset"], opts["task_filter"], opts["max_tasks"], False)
    tasks = [
        HarborTask(task_name=t.name, instruction=t.instruction, task_dir=t.folder, config=t.config)
        for t in found
    ]
    factory = None
    if plan["sandbox"] == "docker":
        stats = Path(plan["run_dir"]) / STATS_FILE
        factory = DockerSandboxFactory(found, run_id(plan["run_dir"]), stats_path=stats)
    builder = HarborDatasetBuilder(
        tasks=tasks,
        batch_size=opts["groups_per_batch"],
        group_size=opts["group_size"],
        model_name=opts["model"],
        renderer_name=plan["renderer"],
        max_turns=opts["max_turns"],
        sandbox_timeout=opts["env_timeout"],
        command_timeout=opts["command_timeout"],
        grader_timeout=GRADER_TIMEOUT_S,
        max_trajectory_tokens=MAX_TRAJECTORY_TOKENS,
        max_generation_tokens=opts["max_tokens"],
        sandbox_factory=factory,
    )
    return policy_config(spec, builder, "rlcli_harbor")


REWARD, PASSED = "env/all/reward/total", "env/all/test_passed"
SAMPLED_TOKENS = "env/all/total_ac_tokens"


def _remove_on_sigterm(run: str) -> None:
    """SIGTERM (the parent stopping the run): remove the run's containers, then exit 143."""
    import signal
    import sys

    def on_term(signum, frame):
        from rlcli.harbor import docker

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        docker.remove_live_containers()
        docker.remove_run_containers(run)
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)


def run_in_child(spec: dict) -> dict:
    import asyncio

    from tinker_cookbook.rl import train

    from rlcli.compat import harbor_hooks
    from rlcli.harbor import docker

    harbor_hooks.install_harbor_hooks()
    config = cookbook_config(spec)
    seed_sampling(spec["options"]["seed"])
    run = run_id(config.log_path)
    docker.remove_run_containers(run)  # what an earlier attempt killed with its parent left
    _remove_on_sigterm(run)
    try:
        asyncio.run(train.main(config))
    finally:
        docker.remove_live_containers()
        docker.remove_run_containers(run)
    return policy_summary(config, {"final_passed": PASSED})


COMMAND = "rlcli train harbor"
SHOW = {REWARD: "reward", PASSED: "passed"}
TOKENS_KEY = SAMPLED_TOKENS


def describe(plan: HarborPlan, served_by: str = "") -> str:
    backend = f" ({served_by} backend)" if served_by else ""
    return (
        f"loss {plan.loss}{backend}, {len(plan.tasks)} tasks, {plan.steps} steps of "
        f"{plan.rollouts_per_step} rollouts in {plan.sandbox} containers"
    )


def resume_hint(opts: HarborOptions, plan: HarborPlan) -> str:
    return resume_command(COMMAND, plan.run_dir)

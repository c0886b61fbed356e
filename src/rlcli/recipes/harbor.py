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

import contextlib
import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from rlcli.compat import harbor_hooks
from rlcli.compat.harbor_hooks import import_harbor_env
from rlcli.compat.renderer_choice import resolve_renderer
from rlcli.errors import RlcliError
from rlcli.flags import option, retune
from rlcli.harbor import docker
from rlcli.harbor.docker import STATS_FILE, DockerSandboxFactory
from rlcli.harbor.tasks import GRADER_TIMEOUT_S, MAX_TRAJECTORY_TOKENS, dataset_tasks
from rlcli.recipes import base
from rlcli.recipes.base import Recipe
from rlcli.recipes.options import PolicyOptions, TrainOptions
from rlcli.recipes.rl import (
    PolicyPlan,
    check_policy_flags,
    check_policy_server,
    policy_config,
    policy_summary,
    seed_sampling,
)
from rlcli.runs.folder import SPEC


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
class HarborPlan(PolicyPlan):
    tasks: list[str]
    groups_per_step: int
    rollouts_per_step: int
    sandbox: str


def run_id(run_dir: str | Path) -> str:
    """The label value of a run's containers: a hash of its folder (same folder, same id, so a
    resume also removes what a killed attempt left)."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


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


def _remove_on_sigterm(run: str) -> None:
    """SIGTERM (the parent stopping the run): remove the run's containers, then exit 143."""
    import signal
    import sys

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        docker.remove_live_containers()
        docker.remove_run_containers(run)
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)


REWARD, PASSED = "env/all/reward/total", "env/all/test_passed"
SAMPLED_TOKENS = "env/all/total_ac_tokens"


class Harbor(Recipe):
    name = "harbor"
    options = HarborOptions
    help = (
        "Agent RL on Harbor tasks (a container, an instruction, a test script whose verdict "
        "is the reward) in containers on the local Docker daemon, with the cookbook's harbor_rl."
    )
    show = {REWARD: "reward", PASSED: "passed"}
    tokens_key = SAMPLED_TOKENS

    def prepare(self, opts: HarborOptions, stdin=None, dry_run=False) -> tuple[HarborPlan, None]:
        """Check flags, model, renderer and every task folder, and count the steps; no server,
        no sandbox, no writes."""
        config = check_policy_flags(opts)
        if opts.sandbox == "modal":
            check_modal()
        folder, source, found = dataset_tasks(opts.dataset, opts.task_filter, opts.max_tasks)
        renderer, renderer_source, _ = resolve_renderer(opts.model, opts.renderer)
        run_dir = self.run_dir_of(opts)
        groups = min(opts.groups_per_batch, len(found))
        plan = HarborPlan(
            run_dir=str(run_dir),
            loss=opts.loss,
            loss_config=config,
            dataset=opts.dataset if source.startswith("Harbor cache") else str(folder),
            data_source=source,
            tasks=[t.name for t in found],
            groups_per_step=groups,
            rollouts_per_step=groups * opts.group_size,
            steps=base.capped(math.ceil(len(found) / opts.groups_per_batch), opts),
            sandbox=opts.sandbox,
            renderer=renderer,
            renderer_source=renderer_source,
            resuming=base.resuming(run_dir),
        )
        return plan, None

    def check_server(self, server, opts: HarborOptions, plan: HarborPlan, report) -> str:
        """Before any rollout: the RL-style server checks, then the sandbox: the Docker daemon
        answers and every task's image is there (built now when missing)."""
        served_by = check_policy_server(server, opts, plan.loss_config, report)
        if plan.sandbox == "docker":
            version = docker.check_daemon()
            _, _, found = dataset_tasks(
                plan.dataset, opts.task_filter, opts.max_tasks, download=False
            )
            built = []
            for task in found:
                if docker.needs_build(task):
                    report(f"building the image of task {task.name} ({task.environment})")
                tag, new = docker.ensure_image(task)
                if new:
                    built.append(tag)
            report(
                f"docker {version} at {docker.where()}: {len(found)} task images ready"
                + (f" ({len(built)} built now)" if built else "")
            )
        return served_by

    def resolved_fields(self, opts: HarborOptions, plan: HarborPlan, base_url: str) -> dict:
        """A local dataset as an absolute path (``--config`` of the run: the same tasks)."""
        return {"dataset": plan.dataset}

    def describe(self, plan: HarborPlan, served_by: str = "") -> str:
        backend = f" ({served_by} backend)" if served_by else ""
        return (
            f"loss {plan.loss}{backend}, {len(plan.tasks)} tasks, {plan.steps} steps of "
            f"{plan.rollouts_per_step} rollouts in {plan.sandbox} containers"
        )

    @contextlib.contextmanager
    def around(self, opts: HarborOptions, report):
        """Remove every container of the run, whatever way it ended (the recipe child's own
        cleanup cannot run when it is SIGKILLed). A dry run makes none; a detached run cleans
        up in its own process."""
        if opts.dry_run or opts.detach or opts.sandbox != "docker":
            yield opts
            return
        run_dir = self.run_dir_of(opts)
        try:
            yield dataclasses.replace(opts, log_path=str(run_dir))
        finally:
            # Only once a recipe may have started (a refused run made no container).
            ran = (run_dir / SPEC).exists()
            left = docker.remove_run_containers(run_id(run_dir)) if ran else 0
            if left:
                report(f"removed {left} container(s) the run left behind")

    # ---- in the recipe child ----------------------------------------------------------------

    def cookbook_config(self, spec: dict):
        harbor_env = import_harbor_env()  # modal need not be installed
        HarborDatasetBuilder, HarborTask = harbor_env.HarborDatasetBuilder, harbor_env.HarborTask

        opts, plan = spec["options"], spec["plan"]
        _, _, found = dataset_tasks(plan["dataset"], opts["task_filter"], opts["max_tasks"], False)
        tasks = [
            HarborTask(
                task_name=t.name, instruction=t.instruction, task_dir=t.folder, config=t.config
            )
            for t in found
        ]
        factory = None
        if plan["sandbox"] == "docker":
            stats = Path(plan["run_dir"]) / STATS_FILE
            factory = DockerSandboxFactory(found, run_id(plan["run_dir"]), stats_path=stats)
        builder = HarborDatasetBuilder(
            **base.picked(opts, "group_size", "max_turns", "command_timeout"),
            tasks=tasks,
            batch_size=opts["groups_per_batch"],
            model_name=opts["model"],
            renderer_name=plan["renderer"],
            sandbox_timeout=opts["env_timeout"],
            grader_timeout=GRADER_TIMEOUT_S,
            max_trajectory_tokens=MAX_TRAJECTORY_TOKENS,
            max_generation_tokens=opts["max_tokens"],
            sandbox_factory=factory,
        )
        return policy_config(self, spec, builder)

    def run_in_child(self, spec: dict) -> dict:
        import asyncio

        from tinker_cookbook.rl import train

        harbor_hooks.install_harbor_hooks()
        config = self.cookbook_config(spec)
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

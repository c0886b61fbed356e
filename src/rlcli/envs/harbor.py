"""Harbor tasks as an environment of ``rlcli eval rl``: a task is one multi-turn episode, not one
answer, so this environment is ``multi_turn`` and is scored through ``episodes`` instead of
``make_env``.

An episode is exactly what ``rlcli train harbor`` rolls out: the cookbook's
``recipes/harbor_rl`` ``HarborEnvGroupBuilder`` (bash tool, turn limit, context overflow) with
rlcli's Docker sandbox and verifier plugged in (``harbor_hooks.install_harbor_hooks``), run
through the cookbook's ``rl.rollouts.do_group_rollout`` with one env in the group; its reward is the
rollout's total reward, the verifier's verdict, so training and evaluation grade alike.

Loading (``HarborTasks(spec)``) resolves and validates every task folder (no daemon needed);
``prepare`` checks the daemon and builds missing images before anything is sampled; every
container of an ``episodes`` block carries its own label and is removed when the block ends,
whatever way (an exception, Ctrl-C, SIGTERM turned into ``SystemExit`` by the CLI).
``train rl --dataset`` still refuses Harbor tasks (``rlcli train harbor`` trains on them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlcli.compat import harbor_hooks
from rlcli.envs.base import Environment, Problems
from rlcli.errors import RlcliError
from rlcli.harbor import docker
from rlcli.harbor.tasks import GRADER_TIMEOUT_S, MAX_TRAJECTORY_TOKENS, dataset_tasks

TURN_MARK = "[turn {n}]"  # heads each assistant turn in an episode's response


@dataclass
class Episode:
    response: str  # every assistant turn as the model wrote it, each headed "[turn N]"
    reward: float
    tokens: int  # sampled over all turns
    turns: int


def _reflag(message: str, flag: str, spec: str) -> str:
    """The task loader's and sandbox's errors name ``train harbor``'s flags; say ours."""
    if message.startswith("--sandbox docker:"):
        message = f"{flag} {spec}:" + message.removeprefix("--sandbox docker:")
    return message.replace("--dataset ", f"{flag} ")


class HarborTasks(Environment):
    """A folder of Harbor task folders, one task folder, or ``name@version`` from the Harbor
    cache (downloaded when missing), filtered by ``task_filter``; rows in task-name order."""

    name = "harbor"
    multi_turn = True

    def __init__(self, spec: str, flag: str = "--env", task_filter: str | None = None) -> None:
        self.spec, self.flag = spec, flag
        try:
            self.folder, self._source, self.specs = dataset_tasks(spec, task_filter, None)
        except RlcliError as e:
            raise RlcliError(_reflag(str(e), flag, spec)) from None

    @property
    def source(self) -> str:
        return f"Harbor tasks, {self._source} ({self.folder})"

    def rows(self, split: str) -> list[dict]:
        """One split: the tasks (``train harbor`` trains on the same folders)."""
        return [{"id": t.name, "question": t.instruction} for t in self.specs]

    def problems(self, split: str, seed: int, count: int | None = None, *, shuffle=True):
        """The first ``count`` tasks by name, whatever the seed (like ``train harbor
        --max-tasks``): a benchmark's tasks are a fixed set, picked with ``--task-filter``."""
        rows = self.rows(split)[:count]
        return Problems(self, split, seed, len(rows), rows)

    def make_env(self, row: dict, renderer):
        raise RlcliError(f"{self.flag} {self.spec}: Harbor tasks are episodes; use episodes()")

    def prepare(self, say: Callable[[str], None]) -> None:
        """The daemon answers and every task's image is there (built now when missing), before
        any sampling; one line when not."""
        try:
            version = docker.check_daemon()
            built = 0
            for task in self.specs:
                if docker.needs_build(task):
                    say(f"building the image of task {task.name} ({task.environment})")
                built += docker.ensure_image(task)[1]
        except RlcliError as e:
            raise RlcliError(_reflag(str(e), self.flag, self.spec)) from None
        say(
            f"docker {version} at {docker.where()}: {len(self.specs)} task images ready"
            + (f" ({built} built now)" if built else "")
        )

    @contextlib.contextmanager
    def episodes(
        self,
        model: str,
        renderer_name: str,
        *,
        max_turns: int,
        command_timeout: int,
        env_timeout: int,
        max_tokens: int,
        context: int | None = None,
    ):
        """Yields ``play(row, policy) -> Episode`` (an async function: one episode of the task
        with the cookbook ``TokenCompleter`` ``policy``, ``max_tokens`` per turn); afterwards
        no container of the block is left, whatever way it ended. ``context``: the model's; an
        episode ends (the cookbook's context-overflow reward) before its next turn would not
        fit, as at ``train harbor``'s 32K-token cap."""
        import uuid

        from tinker_cookbook.rl.rollouts import do_group_rollout
        from tinker_cookbook.tokenizer_utils import get_tokenizer

        harbor_env = harbor_hooks.import_harbor_env()
        harbor_hooks.install_harbor_hooks()
        tokenizer = get_tokenizer(model)
        label = f"eval-{uuid.uuid4().hex[:12]}"
        factory = docker.DockerSandboxFactory(self.specs, label)
        by_name = {t.name: t for t in self.specs}
        longest = min(MAX_TRAJECTORY_TOKENS, context or MAX_TRAJECTORY_TOKENS)

        async def play(row: dict, policy) -> Episode:
            spec = by_name[row["id"]]
            task = harbor_env.HarborTask(
                task_name=spec.name, instruction=spec.instruction, task_dir=Path(spec.folder),
                config=spec.config,
            )  # fmt: skip
            builder = harbor_env.HarborEnvGroupBuilder(
                task=task, model_name=model, renderer_name=renderer_name, max_turns=max_turns,
                group_size=1, sandbox_timeout=env_timeout, command_timeout=command_timeout,
                grader_timeout=GRADER_TIMEOUT_S, max_trajectory_tokens=longest,
                max_generation_tokens=max_tokens, sandbox_factory=factory,
            )  # fmt: skip
            group = await do_group_rollout(builder, policy)  # removes its container after
            (trajectory,) = group.trajectories_G
            actions = [list(t.ac.tokens) for t in trajectory.transitions]
            response = "\n\n".join(
                f"{TURN_MARK.format(n=n)} {tokenizer.decode(tokens)}"
                for n, tokens in enumerate(actions, 1)
            )
            return Episode(
                response=response,
                reward=float(group.get_total_rewards()[0]),
                tokens=sum(len(a) for a in actions),
                turns=len(actions),
            )

        try:
            yield play
        finally:
            docker.remove_run_containers(label)

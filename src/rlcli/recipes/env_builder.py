"""A cookbook ``RLDatasetBuilder`` over any environment of the registry (``rlcli.envs``).

Each problem becomes the cookbook's ``ProblemGroupBuilder`` of ``group_size`` envs made by the
environment's ``make_env``, exactly as the cookbook's own datasets do (for GSM8K: ``MathEnv``
with its few-shot prefix, as ``Gsm8kDataset`` builds it), so ``eval rl`` grades with the same
objects. Train problems are shuffled (data) or drawn (generated) by ``seed``; the test set is the
first ``eval_size`` test problems in file order (generated: the test stream of ``seed``).
"""

from __future__ import annotations

import math
from functools import partial

import chz
from tinker_cookbook import renderers
from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from rlcli import envs


class EnvDataset(RLDataset):
    def __init__(self, env, problems, batch_size: int, group_size: int, renderer) -> None:
        self.env, self.problems, self.renderer = env, problems, renderer
        self.batch_size, self.group_size = batch_size, group_size

    def get_batch(self, index: int):
        start = index * self.batch_size
        end = min(start + self.batch_size, len(self.problems))
        assert start < end, "batch index past the end of the problems"
        return [
            ProblemGroupBuilder(
                env_thunk=partial(self.env.make_env, row, self.renderer),
                num_envs=self.group_size,
                dataset_name=self.env.name,
            )
            for row in self.problems[start:end]
        ]

    def __len__(self) -> int:
        return math.ceil(len(self.problems) / self.batch_size)


@chz.chz
class EnvDatasetBuilder(RLDatasetBuilder):
    dataset: str  # an environment spec: gsm8k, arithmetic, niah:..., a JSONL path
    batch_size: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str
    data_dir: str | None = None  # GSM8K's folder (None: $RLCLI_GSM8K_DIR, else the hub)
    eval_size: int = 0  # test problems for evaluation (0: no test set)
    seed: int = 0
    reward: str | None = None  # a user's FILE.py:FUNCTION grading a JSONL (envs/reward_fn.py)
    reward_timeout: float = 10.0
    reward_errors_path: str | None = None

    async def __call__(self):
        reward = None
        if self.reward:
            path, _, name = self.reward.rpartition(":")
            reward = {
                "path": path, "name": name, "timeout": self.reward_timeout,
                "errors_path": self.reward_errors_path,
            }  # fmt: skip
        env = envs.get(self.dataset, flag="--dataset", gsm8k_dir=self.data_dir, reward=reward)
        renderer = renderers.get_renderer(
            self.renderer_name, tokenizer=get_tokenizer(self.model_name_for_tokenizer)
        )
        count = env.train_batches * self.batch_size if env.generated else None
        train = env.problems("train", self.seed, count)
        dataset = EnvDataset(env, train, self.batch_size, self.group_size, renderer)
        if not self.eval_size:
            return dataset, None
        test = env.problems("test", self.seed, self.eval_size, shuffle=False)
        return dataset, EnvDataset(env, test, len(test), 1, renderer)

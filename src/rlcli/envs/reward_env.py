"""The cookbook ``Env`` of one row scored by a user's ``--reward`` function (``reward_fn.py``):
the row's question as the user turn, the sampled answer's text to the function, its number as
the reward (no format bonus or penalty: the function is the whole reward, as in TRL)."""

from __future__ import annotations

import asyncio

import tinker
from tinker_cookbook import renderers
from tinker_cookbook.rl.types import Env, StepResult

from rlcli.envs.reward_fn import Scorer, row_kwargs


class RewardFnEnv(Env):
    def __init__(self, row: dict, renderer: renderers.Renderer, scorer: Scorer) -> None:
        self.row, self.renderer, self.scorer = row, renderer, scorer

    async def initial_observation(self):
        convo = [{"role": "user", "content": self.row["question"]}]
        return self.renderer.build_generation_prompt(convo), self.renderer.get_stop_sequences()

    async def step(self, action, *, extra=None) -> StepResult:
        message, _ = self.renderer.parse_response(action)
        answer = renderers.get_text_content(message)
        row = self.row
        reward, error = await asyncio.to_thread(  # the scorer blocks on its worker's pipe
            self.scorer, row["id"], row["question"], answer, row_kwargs(row["fields"])
        )
        return StepResult(
            reward=reward,
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.renderer.get_stop_sequences(),
            metrics={"reward_error": float(error is not None)},
        )

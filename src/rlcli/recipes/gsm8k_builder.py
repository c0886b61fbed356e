"""A cookbook ``RLDatasetBuilder`` for GSM8K that reads rows from a folder or the hub.

Same problems, prompts (the cookbook's few-shot prefix and question suffix) and grading as the
cookbook's ``Gsm8kDatasetBuilder``; only where the rows come from differs.
"""

from __future__ import annotations

import random

import chz
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.math_env import MathEnv
from tinker_cookbook.rl.types import RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from rlcli.compat import gsm8k_dataset
from rlcli.data import gsm8k


@chz.chz
class Gsm8kRowsBuilder(RLDatasetBuilder):
    batch_size: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str
    data_dir: str | None = None  # None: the hub
    eval_size: int = 0  # test problems for evaluation (0: no test set)
    seed: int = 0

    async def __call__(self):
        folder = gsm8k.resolve_dir(self.data_dir)
        renderer = renderers.get_renderer(
            self.renderer_name, tokenizer=get_tokenizer(self.model_name_for_tokenizer)
        )
        prefix = MathEnv.standard_fewshot_prefix()
        train_rows = gsm8k.load_rows(folder, "train")
        random.Random(self.seed).shuffle(train_rows)
        train = gsm8k_dataset(train_rows, self.batch_size, self.group_size, renderer, prefix)
        if not self.eval_size:
            return train, None
        test_rows = gsm8k.load_rows(folder, "test")[: self.eval_size]
        return train, gsm8k_dataset(test_rows, len(test_rows), 1, renderer, prefix)

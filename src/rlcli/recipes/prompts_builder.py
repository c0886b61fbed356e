"""A cookbook ``RLDatasetBuilder`` over a validated prompts file, for ``train opsd``.

The cookbook's own distillation builders download their prompts from the hub; this one reads
rlcli's prompts file (``data/prompts.py``), shuffled by the run's seed, and keeps each
prompt's own context turns (``distill.prompts_dataset``).
"""

from __future__ import annotations

import chz
from tinker_cookbook import renderers
from tinker_cookbook.rl.types import RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from rlcli.compat.distill import prompts_dataset


@chz.chz
class PromptsBuilder(RLDatasetBuilder):
    dataset_path: str
    batch_size: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str
    seed: int = 0

    async def __call__(self):
        from rlcli.recipes.opsd import shuffled_prompts

        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
        prompts = shuffled_prompts(self.dataset_path, self.seed)
        return prompts_dataset(prompts, self.batch_size, self.group_size, renderer, tokenizer), None

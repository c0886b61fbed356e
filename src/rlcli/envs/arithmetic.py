"""Arithmetic: the cookbook's ``ArithmeticEnv`` ("What is x + y?", x and y in 0..100, its
one-shot prefix and integer grading) with problems drawn from ``--seed``.

The cookbook's own ``ArithmeticDataset`` seeds batch i with i whatever the run's seed, and its
train and test problems could coincide; here each row has its own seeded stream, and the pairs
are split once by a hash: about one in ten (x, y) pairs is a test problem and is never trained
on. One ``train rl`` pass is the cookbook's 100 batches.
"""

from __future__ import annotations

import hashlib

from rlcli.envs.base import Environment, stream

TEST_SHARE = 10  # one pair in TEST_SHARE is held out for evaluation


def is_test_pair(x: int, y: int) -> bool:
    return int.from_bytes(hashlib.sha256(f"{x}+{y}".encode()).digest()[:4], "big") % TEST_SHARE == 0


class Arithmetic(Environment):
    name = "arithmetic"
    generated = True
    train_batches = 100  # tinker_cookbook.recipes.math_rl.train: n_batches=100

    @property
    def source(self) -> str:
        return "generated (the cookbook's arithmetic_env)"

    def generate(self, split: str, seed: int, index: int) -> dict:
        rng = stream(self.name, split, seed, index)
        while True:
            x, y = rng.randint(0, 100), rng.randint(0, 100)
            if is_test_pair(x, y) == (split == "test"):
                return {"id": f"{split}-{seed}-{index}", "x": x, "y": y}

    def make_env(self, row: dict, renderer):
        from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv

        return ArithmeticEnv(
            row["x"], row["y"], renderer, convo_prefix=ArithmeticEnv.standard_fewshot_prefix()
        )

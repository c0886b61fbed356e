"""GSM8K: the cookbook's ``MathEnv`` with its few-shot prefix, as its ``Gsm8kDataset`` builds
it, over rows from a local folder or the hub (``data/gsm8k.py``)."""

from __future__ import annotations

from functools import cache

from rlcli.data import gsm8k
from rlcli.envs.base import Environment


class Gsm8k(Environment):
    name = "gsm8k"

    def __init__(self, data_dir: str | None = None) -> None:
        self.folder = gsm8k.resolve_dir(data_dir)  # checked now: one line if it is wrong

    @property
    def source(self) -> str:
        return str(self.folder) if self.folder else f"hub:{gsm8k.HUB_ID}"

    def count(self, split: str) -> int | None:
        if self.folder is not None:  # without parsing (plans of 7k rows stay instant)
            return gsm8k.count_rows(self.folder, split)
        return len(self.rows(split))

    def rows(self, split: str) -> list[dict]:
        return _rows(self.folder, split)

    def make_env(self, row: dict, renderer):
        from tinker_cookbook.recipes.math_rl.math_env import MathEnv

        return MathEnv(
            row["question"], row["answer"], renderer, convo_prefix=MathEnv.standard_fewshot_prefix()
        )


@cache
def _rows(folder, split: str) -> list[dict]:
    """Rows with their final answer extracted as the cookbook does; a row without one is
    skipped, as the cookbook's ``Gsm8kDataset`` skips it."""
    from tinker_cookbook.recipes.math_rl.math_env import extract_gsm8k_final_answer

    out = []
    for i, row in enumerate(gsm8k.load_rows(folder, split)):
        try:
            answer = extract_gsm8k_final_answer(row["answer"])
        except (ValueError, KeyError, TypeError):
            continue
        out.append({"id": f"{split}-{i}", "question": row["question"], "answer": answer})
    return out

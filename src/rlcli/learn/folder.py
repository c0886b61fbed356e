"""A learning alias's folder, ``$RLCLI_HOME/learn/<alias>/``: the one owner of its file names.

One subfolder per round (``001``, ``002``, ...), each written in this order: ``plan.json`` (the
round exists), ``train.jsonl`` and ``run/``, ``trained.json``, ``evaluated.json``,
``receipt.json`` (the round is done); beside them ``regression.jsonl``, ``scores.png``, ``lock``.
"""

from __future__ import annotations

from pathlib import Path

from rlcli.home import rlcli_home

PLAN, TRAIN, TRAINED, EVALUATED, RECEIPT = (
    "plan.json", "train.jsonl", "trained.json", "evaluated.json", "receipt.json",
)  # fmt: skip
REGRESSION = "regression.jsonl"  # frozen from the first round's held-out unless --regression
PLOT = "scores.png"
LOCK = "lock"


def learn_dir(alias: str) -> Path:
    return rlcli_home() / "learn" / alias


def rounds(alias: str) -> list[Path]:
    """The alias's round folders that have a plan, oldest first."""
    found = [p for p in learn_dir(alias).glob("[0-9][0-9][0-9]") if (p / PLAN).exists()]
    return sorted(found)

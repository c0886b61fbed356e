"""rlcli: a Tinker-API server and a CLI over tinker-cookbook recipes, usable from Python too.

``from rlcli import train, SLOptions`` runs what ``rlcli train sl`` runs (``docs/python-api.md``;
the functions live in ``rlcli.api``). Names load on first use, so ``import rlcli`` stays light.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "train": "rlcli.api",
    "evaluate": "rlcli.api",
    "internalize": "rlcli.api",
    "learn_round": "rlcli.api",  # not "learn": the package rlcli.learn has that name
    "LearnOptions": "rlcli.learn.round",
    "InternalizeOptions": "rlcli.recipes.internalize",
    "export": "rlcli.api",
    "Message": "rlcli.api",
    "Step": "rlcli.api",
    "Checkpoint": "rlcli.api",
    "Tasks": "rlcli.api",
    "SLOptions": "rlcli.recipes.sl",
    "RLOptions": "rlcli.recipes.rl",
    "DPOOptions": "rlcli.recipes.dpo",
    "OpsdOptions": "rlcli.recipes.opsd",
    "HarborOptions": "rlcli.recipes.harbor",
    "D2LOptions": "rlcli.recipes.d2l",
    "Hypernets": "rlcli.client.d2l",
    "EvalOptions": "rlcli.client.evaluate",
    "RlcliError": "rlcli.errors",
    "RunFailed": "rlcli.errors",
    "Cancelled": "rlcli.errors",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'rlcli' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return __all__

"""rlcli's ``train`` commands (one ``Recipe`` per module, ``base.py``) and what drives them.

``REGISTRY`` is the list of commands: adding one is a module with a ``Recipe`` subclass and a
line here. Modules load on first use, so naming the registry imports no recipe.
"""

from __future__ import annotations

import importlib

REGISTRY = {  # the command's name -> "module:Recipe subclass"
    "sl": "rlcli.recipes.sl:SL",
    "rl": "rlcli.recipes.rl:RL",
    "dpo": "rlcli.recipes.dpo:DPO",
    "opsd": "rlcli.recipes.opsd:Opsd",
    "harbor": "rlcli.recipes.harbor:Harbor",
    "d2l": "rlcli.recipes.d2l:D2L",
    "internalize": "rlcli.recipes.internalize:Internalize",  # its own command, rlcli internalize
}
TRAIN = ("sl", "rl", "dpo", "opsd", "harbor", "d2l")  # the recipes that are `rlcli train NAME`


def get(name: str):
    """The recipe of ``rlcli train NAME`` (a ``base.Recipe``); KeyError for an unknown name."""
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)()

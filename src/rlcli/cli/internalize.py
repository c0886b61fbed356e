"""``rlcli internalize DOCUMENT... --model M``: documents into a LoRA (context distillation).

A recipe like the train commands (``recipes/internalize.py``, its child's work
``recipes/internalize_child.py``), driven by the same flow, so it prints what ``rlcli train``
prints: the plan, the start line, progress, then the summary with the receipt (base / in
context / internalized / control on the held-out probes).
"""

from __future__ import annotations

from rlcli import flags
from rlcli.recipes import get


def register(app) -> None:
    from rlcli.cli.train import run_recipe_command

    recipe = get("internalize")
    flags.typer_command(
        app,
        "internalize",
        recipe.options,
        lambda opts: run_recipe_command(recipe, opts),
        help=recipe.help,
    )

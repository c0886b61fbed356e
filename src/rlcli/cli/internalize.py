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

    def run(opts) -> None:
        if not opts.hypernet:
            run_recipe_command(recipe, opts)
            return
        import sys

        from rlcli.cli._output import emit
        from rlcli.recipes import internalize_hypernet

        done = internalize_hypernet.run(opts, stdin=sys.stdin)
        emit(done.summary, as_json=opts.json, title="internalized")

    flags.typer_command(app, "internalize", recipe.options, run, help=recipe.help)

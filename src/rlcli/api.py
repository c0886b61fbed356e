"""rlcli's Python API: the ``train``, ``eval``, ``learn`` and ``export`` commands from a script.

The same options dataclasses as the CLI (``SLOptions``, ``RLOptions``, ...: one field per
flag, same defaults and checks), the same flow and run folder, the same refusals. What the
CLI prints as progress comes to ``on_progress`` as events (``Message``, ``Step``,
``Checkpoint``, ``Tasks``); what it turns into an exit status comes as an exception:

- a refusal (bad options, data, server): ``RlcliError``, its message the CLI's one line;
- a run that started and did not finish: ``RunFailed`` (``.run_dir``, ``.error``);
- ``rlcli runs cancel``: ``Cancelled`` (a checkpoint was saved first);
- Ctrl-C: ``KeyboardInterrupt``, after the checkpoint the CLI saves too.

See ``docs/python-api.md``. Nothing heavy is imported until a function runs.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcli import recipes
from rlcli.client import evaluate as evaluating
from rlcli.errors import RunFailed
from rlcli.flags import check
from rlcli.runs.catalog import checkpoint_path
from rlcli.runs.progress import describe_status


@dataclass
class Message:
    """A line the CLI would print on stderr (a check passed, a phase of the run)."""

    text: str


@dataclass
class Step:
    """A training step finished: its metrics by the CLI's labels (``loss``, ``reward``...)."""

    step: int
    total: int
    metrics: dict[str, float]
    tokens_per_s: float | None = None
    eta_s: float | None = None


@dataclass
class Checkpoint:
    """The run saved a checkpoint (a row of its ``checkpoints.jsonl``)."""

    name: str | None
    state_path: str | None
    sampler_path: str | None
    row: dict = field(default_factory=dict)


@dataclass
class Tasks:
    """``evaluate``: ``done`` of ``total`` tasks scored for ``policy`` (base / checkpoint)."""

    policy: str
    done: int
    total: int


Event = Message | Step | Checkpoint | Tasks
OnProgress = Callable[[Event], None]


class _Events:
    """The ``progress.Reporter`` that hands each event to ``on_progress``."""

    def __init__(self, on_progress: OnProgress | None) -> None:
        self.on_progress = on_progress or (lambda event: None)

    def message(self, text: str) -> None:
        self.on_progress(Message(text))

    def step(self, line) -> None:
        self.on_progress(Step(line.step, line.total, line.values, line.tokens_per_s, line.eta_s))

    def phase(self, status: dict) -> None:
        text = describe_status(status)
        if text:
            self.on_progress(Message(text))

    def checkpoint(self, row: dict) -> None:
        self.on_progress(
            Checkpoint(row.get("name"), row.get("state_path"), row.get("sampler_path"), row)
        )

    def close(self) -> None:
        pass


def _recipe_of(options):
    for name in recipes.REGISTRY:
        recipe = recipes.get(name)
        if type(options) is recipe.options:
            return recipe
    raise TypeError(f"{type(options).__name__}: not the options of a train command")


def train(options, *, on_progress: OnProgress | None = None, stdin=None):
    """Run ``rlcli train`` with ``options`` (``SLOptions``, ``RLOptions``, ``DPOOptions``,
    ``OpsdOptions``, ``HarborOptions``, ``InternalizeOptions``); the command is the options'
    type. Returns the outcome: ``.summary`` (what ``done`` prints: ``run_dir``, ``state_path``,
    ``sampler_path``, the first and final metrics), ``.plan``, ``.options`` (as saved in the
    run's config.yaml), ``.run_dir``; with ``dry_run=True`` only the plan. ``stdin``: where
    ``dataset="-"`` reads (default: ``sys.stdin``). Raises as the module docstring says."""
    from rlcli.recipes import flow

    if getattr(options, "hypernet", None):  # internalize's doc-to-LoRA route: no flow
        return internalize(options, on_progress=on_progress, stdin=stdin)
    recipe = _recipe_of(options)
    opts = dataclasses.replace(options)  # the flow fills in what it finds; yours stays as is
    check(opts)
    events = _Events(on_progress)
    try:
        return flow.train(
            recipe, opts, say=events.message, progress=events, stdin=stdin or sys.stdin
        )
    except RunFailed as e:
        if e.exit_code == 130:  # Ctrl-C, after the checkpoint the recipe saved
            raise KeyboardInterrupt(str(e)) from e
        raise


def internalize(options, *, on_progress: OnProgress | None = None, stdin=None):
    """Run ``rlcli internalize`` with ``options`` (``InternalizeOptions``: ``documents``, a
    list of paths, and ``model`` at least). Returns the outcome as ``train`` does; its
    ``.summary["receipt"]`` holds the held-out scores (base, in context, internalized,
    control), per document and per probe. ``stdin``: where a document ``"-"`` is read.

    With ``hypernet`` (a ``tinker://ID/hypernet_weights/NAME``): one document's adapter from
    one forward pass of that hypernetwork, no training; the outcome's ``.summary`` holds its
    ``sampler_path`` (and ``reused``, ``expires_at``, ``tokens``, ``chunks``, ``rank``); there is
    no run folder, and ``on_progress`` gets nothing."""
    from rlcli.recipes.internalize import InternalizeOptions

    if not isinstance(options, InternalizeOptions):
        raise TypeError(f"{type(options).__name__}: expected InternalizeOptions")
    if options.hypernet:
        from rlcli.recipes import internalize_hypernet

        check(options)
        return internalize_hypernet.run(options, stdin=stdin or sys.stdin)
    return train(options, on_progress=on_progress, stdin=stdin)


def learn_round(options, *, on_progress: OnProgress | None = None) -> dict:
    """Run one ``rlcli learn`` round with ``options`` (``LearnOptions``): new judged traces ->
    train from the alias's state -> the gate -> promote or keep. Returns the round's receipt
    (with ``dry_run=True``, its plan), as ``--json`` prints it; the round's lines come to
    ``on_progress`` as ``Message``. Too few new judged traces, or a concurrent round on the
    alias: ``RlcliError``, as the CLI's one line. ``--watch`` is a loop over this."""
    from rlcli.learn.round import run_round

    return run_round(options, _Events(on_progress).message)


def evaluate(options, *, on_progress: OnProgress | None = None) -> dict:
    """Run ``rlcli eval rl`` with ``options`` (``EvalOptions``); returns what ``--json``
    prints: the scores (and with ``compare=True`` base, checkpoint and difference)."""
    check(options)
    events = _Events(on_progress)

    def tasks(label: str, done: int, total: int) -> None:
        events.on_progress(Tasks(label, done, total))

    return evaluating.evaluate(options, report=tasks, info=events.message)


def export(
    source: str, output: str | Path, *, on_progress: OnProgress | None = None, **flags: Any
) -> dict[str, Any]:
    """Run ``rlcli export``: ``source`` is a ``tinker://`` checkpoint, or a run (its id, a
    unique prefix, or its folder: its last checkpoint); ``output`` the folder (``gguf``: the
    file) to write; ``flags`` are its flags, as ``ExportOptions`` names them (``merge``,
    ``with_optimizer``, ``gguf``, ``gguf_type``, ``base_model``, ``force``, ``base_url``).
    Returns what ``--json`` prints (the files written, the source)."""
    from rlcli.client import export as exporting

    options = exporting.ExportOptions(output=str(output), **flags)
    check(options)
    exporting.check_flags(options.gguf, options.with_optimizer)
    path = source
    if not source.startswith("tinker://"):
        path = checkpoint_path(source, options.with_optimizer)
    return exporting.export_checkpoint(path, Path(output), options, _Events(on_progress).message)

"""The recipe interface: what one ``rlcli train`` command is, written once.

A command is a ``Recipe`` subclass in its own module (``sl.py``, ``rl.py``, ...) and one line in
``REGISTRY`` (``recipes/__init__.py``). Its options dataclass (``Recipe.options``) is the single
source of its flags, config keys, dry-run plan and saved config (``options.py``). The flow that
drives every recipe, in the order nothing is written before everything is checked, is
``recipes/flow.py``; the child process runs ``Recipe.run_in_child`` (``child.py``).

The shared parts live here: the run folder (``run_dir_of``), the plan's common fields
(``Plan``), the resolved options and the spec, the resume hint, keeping stdin's data in the run
folder (``read_input`` / ``keep_lines``), the keyword arguments every cookbook config shares
(``cookbook_kwargs``) and the checkpoint part of every summary (``summary_of``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from rlcli.data.chat import stdin_text
from rlcli.errors import RlcliError
from rlcli.files import atomic
from rlcli.flags import saved
from rlcli.recipes.options import resume_command
from rlcli.runs.folder import CHECKPOINTS_FILE

Report = Callable[[str], None]  # one line for the user (the CLI prints it to stderr)


@dataclass
class Plan:
    """What every plan says: where the run goes, how long it is, the renderer, resume or not.
    A recipe's plan subclasses it; ``--dry-run`` prints it, the spec carries it."""

    run_dir: str
    steps: int
    renderer: str
    renderer_source: str
    resuming: bool


class Recipe:
    """One ``rlcli train`` command. Subclasses set the class attributes and implement
    ``prepare``, ``describe``, ``cookbook_config`` and ``run_in_child``; the rest has a
    default that fits most commands."""

    name: ClassVar[str]  # the command: rlcli train NAME (and the spec's "recipe")
    options: ClassVar[type]  # its options dataclass
    help: ClassVar[str]  # the command's --help line
    show: ClassVar[dict[str, str]]  # metrics.jsonl key -> label on the progress line
    tokens_key: ClassVar[str] = "num_tokens"  # per-step tokens behind tokens/s

    @property
    def command(self) -> str:
        return f"rlcli train {self.name}"

    # ---- in the ``rlcli`` process: plan, check, commit ----------------------------------

    def run_dir_of(self, opts) -> Path:
        from rlcli.runs.runner import default_run_dir

        return Path(opts.log_path).expanduser() if opts.log_path else default_run_dir(self.name)

    def prepare(self, opts, stdin=None, dry_run: bool = False) -> tuple[Plan, Any]:
        """Check flags, model, renderer and data and plan the run: no server, no writes.
        Returns the plan and the data ``commit`` keeps (or None)."""
        raise NotImplementedError

    def check_server(self, server, opts, plan: Plan, report: Report) -> str:
        """What the server (``preflight.Server``) can tell beyond the shared checks; returns
        the backend named on the start line."""
        return server.backend or "unknown"

    def notes(self, opts, served_by: str) -> list[str]:
        """Lines said before the run starts, once the backend is known."""
        return []

    def resolved(self, opts, plan: Plan, base_url: str):
        """The options as the run uses them (saved as config.yaml, so ``--config`` of the run
        repeats it): the server, the renderer and the folder found, plus ``resolved_fields``."""
        return dataclasses.replace(
            opts, base_url=base_url, renderer=plan.renderer, log_path=plan.run_dir,
            **self.resolved_fields(opts, plan, base_url),
        )  # fmt: skip

    def resolved_fields(self, opts, plan: Plan, base_url: str) -> dict[str, Any]:
        """The recipe's own resolved fields (e.g. the data file the run reads)."""
        return {}

    def commit(self, opts, plan: Plan, data) -> None:
        """Write what the run needs into its (locked) folder once every check passed."""

    def spec(self, opts, plan: Plan) -> dict:
        """What the child process builds the recipe from (``opts``: resolved)."""
        return {"recipe": self.name, "options": saved(opts), "plan": asdict(plan)}

    def describe(self, plan: Plan, served_by: str = "") -> str:
        """The start line's account of the run: ``training in DIR: <this>``."""
        raise NotImplementedError

    def resume_hint(self, opts, plan: Plan) -> str:
        return resume_command(self.command, plan.run_dir)

    def around(self, opts, report: Report):
        """A context manager around the whole flow, yielding the options to run with (harbor:
        remove the run's containers however it ended)."""
        import contextlib

        return contextlib.nullcontext(opts)

    # ---- in the recipe child process ----------------------------------------------------

    def cookbook_config(self, spec: dict):
        """The cookbook recipe's config, built from the saved spec."""
        raise NotImplementedError

    def run_in_child(self, spec: dict) -> dict:
        """Run the cookbook recipe; returns the run's summary."""
        raise NotImplementedError

    def cookbook_kwargs(self, spec: dict) -> dict[str, Any]:
        """The keyword arguments every cookbook recipe config takes the same way."""
        opts, plan = spec["options"], spec["plan"]
        return {
            "log_path": plan["run_dir"],
            "model_name": opts["model"],
            "recipe_name": f"rlcli_{self.name}",
            "renderer_name": plan["renderer"],
            "learning_rate": opts["lr"],
            "lora_rank": opts["lora_rank"],
            "base_url": opts["base_url"],
            "save_every": opts["save_every"],
            "wandb_project": opts["wandb_project"],
            "wandb_name": opts["wandb_name"],
        }


# ---- helpers the recipes share ----------------------------------------------------------------


def resuming(run_dir: Path) -> bool:
    return (Path(run_dir) / CHECKPOINTS_FILE).exists()  # the cookbook's: one means resume


def capped(steps: int, opts) -> int:
    """``steps``, or ``--max-steps`` when that is fewer."""
    return steps if opts.max_steps is None else min(steps, opts.max_steps)


def read_input(dataset: str, kept: Path, stdin, read) -> tuple[list, Path]:
    """``--dataset``'s rows, read by ``read(lines, source)``, and the file the recipe reads.

    A file is read where it is. Stdin (``-``) is read in memory only: ``keep_lines`` writes it
    into the run folder (``kept``) once every check has passed, so a bad stream or a refused
    run leaves nothing behind; a resumed run with nothing on stdin reuses that copy."""
    if dataset == "-":
        if kept.exists() and (stdin is None or stdin.isatty()):  # a resume: the kept copy
            text = ""
        else:
            text = stdin_text(stdin, "--dataset")
        if not text.strip() and kept.exists():
            with kept.open() as f:
                return read(f, str(kept)), kept
        return read(text.splitlines(), "stdin"), kept
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise RlcliError(f"--dataset {dataset}: no such file")
    with path.open(encoding="utf-8", errors="replace") as f:
        return read(f, str(path)), path.resolve()


def keep_lines(path: Path, rows: Iterable[dict]) -> None:
    """Write ``rows`` as JSONL to ``path`` whole (a temporary file renamed into place), unless
    it already holds exactly them (a resume)."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, text)


def picked(opts: dict, *names: str) -> dict:
    """The saved options ``names``, for a cookbook config whose arguments share their names."""
    return {name: opts[name] for name in names}


def dataset_kwargs(spec: dict, *same: str) -> dict:
    """A cookbook dataset builder's tokenizer and renderer, and the options it names alike."""
    opts, plan = spec["options"], spec["plan"]
    return {
        "model_name_for_tokenizer": opts["model"],
        "renderer_name": plan["renderer"],
        **picked(opts, *same),
    }


def summary_of(log_path: str, about: dict | None = None, **fields) -> dict:
    """A run summary: the folder, ``about`` it, its last checkpoint's paths, then ``fields``."""
    from tinker_cookbook import checkpoint_utils

    last = checkpoint_utils.get_last_checkpoint(log_path)
    return {
        "run_dir": log_path,
        **(about or {}),
        "state_path": last.state_path if last else None,
        "sampler_path": last.get("sampler_path") if last else None,
        **fields,
    }


def first_last(series: dict[str, list[float]], names: dict[str, str]) -> dict:
    """``first_K`` and ``final_K`` for each summary name K -> metric key in ``names``."""
    return {
        **{f"first_{k}": (series[m] or [None])[0] for k, m in names.items()},
        **{f"final_{k}": (series[m] or [None])[-1] for k, m in names.items()},
    }

"""Preference training (DPO) on chosen/rejected pairs: rlcli's layer over the cookbook's
``preference.train_dpo``.

``prepare`` validates every pair (``data/pairs.py``) and plans without a server; ``commit``
writes the pairs, as the cookbook's labeled comparisons, into the run folder (the recipe reads
that file, a resume reuses it); ``cookbook_config`` builds the recipe's config from the saved
spec, with the cookbook's ``ComparisonBuilderFromJsonl`` and ``DPODatasetBuilderFromComparisons``;
``run_in_child`` runs it. The recipe computes the DPO loss on the client
(``forward_backward_custom``: a ``forward`` for the policy's logprobs, the loss and its gradient
in torch, then a ``forward_backward`` whose cross-entropy weights carry that gradient) and the
reference's logprobs with a sampling client's ``compute_logprobs``; the server needs nothing
beyond what supervised training uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rlcli.data.pairs import read_pairs
from rlcli.errors import RlcliError
from rlcli.recipes.options import TrainOptions, option, resume_command, retune, saved
from rlcli.runs.runner import default_run_dir, metric_values

PAIRS_FILE = "pairs.jsonl"  # the cookbook's LabeledComparison rows, in the run folder
SCHEDULES = ("constant", "linear", "cosine")


@dataclass(kw_only=True)
class DPOOptions(TrainOptions):
    dataset: str = option(
        help='Preference JSONL: {"prompt", "chosen", "rejected"} as strings or message '
        'lists, or {"chosen", "rejected"} as whole conversations (their shared start is the '
        "prompt); - for stdin."
    )
    batch_size: int = option(8, "Pairs per step.", min=1)
    lr: float = retune(TrainOptions, "lr", 1e-5)
    lr_schedule: str = option(
        "linear", "How the learning rate falls over the run.", choices=SCHEDULES
    )
    beta: float = option(
        0.1, "DPO beta: how strongly the policy is held to the reference (the base model).", gt=0
    )
    max_length: int = option(2048, "Truncate each prompt + answer to this many tokens.", min=8)
    epochs: int = option(1, "Passes over the pairs.", min=1)


@dataclass
class DPOPlan:
    run_dir: str
    dataset_path: str  # the pairs file the recipe reads (in the run folder)
    pairs: int
    batches_per_epoch: int
    dropped_per_epoch: int  # full batches only, as the cookbook's dataset
    steps: int
    renderer: str
    renderer_source: str
    resuming: bool


def run_dir_of(opts: DPOOptions) -> Path:
    return Path(opts.log_path).expanduser() if opts.log_path else default_run_dir("dpo")


def load_pairs(opts: DPOOptions, run_dir: Path, stdin) -> list[dict]:
    """Every pair, validated (bad lines by number); a resumed run with nothing on stdin reuses
    the folder's copy."""
    kept = run_dir / PAIRS_FILE
    if opts.dataset == "-":
        text = "" if stdin is None or stdin.isatty() else stdin.read()
        if not text.strip() and kept.exists():
            return [json.loads(line) for line in kept.read_text().splitlines() if line.strip()]
        return read_pairs(text.splitlines(), "stdin")
    path = Path(opts.dataset).expanduser()
    if not path.is_file():
        raise RlcliError(f"--dataset {opts.dataset}: no such file")
    with path.open(encoding="utf-8", errors="replace") as f:
        return read_pairs(f, str(path))


def prepare(opts: DPOOptions, stdin=None, dry_run: bool = False) -> tuple[DPOPlan, list[dict]]:
    """Validate the model, renderer and pairs, count the steps; writes nothing."""
    from rlcli.compat.renderer_choice import resolve_renderer
    from rlcli.recipes.preflight import check_model_arg, check_renderer

    check_model_arg(opts.model)
    check_renderer(opts.renderer)
    run_dir = run_dir_of(opts)
    pairs = load_pairs(opts, run_dir, stdin)
    renderer, source, _ = resolve_renderer(opts.model, opts.renderer)
    batches = len(pairs) // opts.batch_size
    if batches == 0:
        raise RlcliError(
            f"--batch-size {opts.batch_size}: larger than the {len(pairs)} pairs; lower it"
        )
    steps = batches * opts.epochs
    if opts.max_steps is not None:
        steps = min(steps, opts.max_steps)
    plan = DPOPlan(
        run_dir=str(run_dir),
        dataset_path=str(run_dir / PAIRS_FILE),
        pairs=len(pairs),
        batches_per_epoch=batches,
        dropped_per_epoch=len(pairs) - batches * opts.batch_size,
        steps=steps,
        renderer=renderer,
        renderer_source=source,
        resuming=(run_dir / "checkpoints.jsonl").exists(),
    )
    return plan, pairs


def check_server(server, opts: DPOOptions, plan: DPOPlan) -> str:
    """Nothing beyond the shared checks; returns the backend for the start line."""
    return server.backend or "unknown"


def commit(opts: DPOOptions, plan: DPOPlan, pairs: list[dict]) -> None:
    """Write the pairs into the run folder (atomically; unchanged on a resume)."""
    kept = Path(plan.dataset_path)
    lines = [json.dumps(p, ensure_ascii=False) + "\n" for p in pairs]
    if kept.exists() and kept.read_text() == "".join(lines):
        return
    kept.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=kept.parent, prefix=".pairs.")
    with os.fdopen(fd, "w") as f:
        f.writelines(lines)
    os.replace(tmp, kept)


def resolved(opts: DPOOptions, plan: DPOPlan, base_url: str) -> DPOOptions:
    """The options a run keeps: the server, the renderer, the folder, the pairs file."""
    return dataclasses.replace(
        opts, base_url=base_url, renderer=plan.renderer, dataset=plan.dataset_path,
        log_path=plan.run_dir,
    )  # fmt: skip


def spec(opts: DPOOptions, plan: DPOPlan) -> dict:
    return {"recipe": "dpo", "options": saved(opts), "plan": asdict(plan)}


def cookbook_config(spec: dict):
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    opts, plan = spec["options"], spec["plan"]
    builder = DPODatasetBuilderFromComparisons(
        comparison_builder=ComparisonBuilderFromJsonl(train_path=plan["dataset_path"]),
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=opts["model"],
            renderer_name=plan["renderer"],
            max_length=opts["max_length"],
            batch_size=opts["batch_size"],
        ),
    )
    return train_dpo.Config(
        log_path=plan["run_dir"],
        model_name=opts["model"],
        recipe_name="rlcli_dpo",
        renderer_name=plan["renderer"],
        dataset_builder=builder,
        learning_rate=opts["lr"],
        lr_schedule=opts["lr_schedule"],
        num_epochs=opts["epochs"],
        dpo_beta=opts["beta"],
        lora_rank=opts["lora_rank"],
        base_url=opts["base_url"],
        save_every=opts["save_every"],
        eval_every=0,
        infrequent_eval_every=0,
        max_steps=opts["max_steps"],
        wandb_project=opts["wandb_project"],
        wandb_name=opts["wandb_name"],
    )


def run_in_child(spec: dict) -> dict:
    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.preference import train_dpo

    from rlcli.compat.run_hooks import install_dpo_hooks

    config = cookbook_config(spec)
    install_dpo_hooks(spec["options"]["seed"], spec["plan"]["batches_per_epoch"])
    train_dpo.main(config)
    last = checkpoint_utils.get_last_checkpoint(config.log_path)
    series = metric_values(Path(config.log_path), LOSS, MARGIN, ACCURACY)
    return {
        "run_dir": config.log_path,
        "state_path": last.state_path if last else None,
        "sampler_path": last.get("sampler_path") if last else None,
        **{f"first_{k}": (series[m] or [None])[0] for k, m in NAMES.items()},
        **{f"final_{k}": (series[m] or [None])[-1] for k, m in NAMES.items()},
    }


LOSS, MARGIN, ACCURACY = "dpo_loss", "margin", "accuracy"
NAMES = {"loss": LOSS, "margin": MARGIN, "accuracy": ACCURACY}
COMMAND = "rlcli train dpo"
SHOW = {LOSS: "loss", MARGIN: "margin", ACCURACY: "acc"}
TOKENS_KEY = "num_tokens"


def describe(plan: DPOPlan, served_by: str = "") -> str:
    return f"{plan.pairs} pairs, {plan.steps} steps"


def resume_hint(opts: DPOOptions, plan: DPOPlan) -> str:
    return resume_command(COMMAND, plan.run_dir)

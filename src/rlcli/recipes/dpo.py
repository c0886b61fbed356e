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

from dataclasses import dataclass
from pathlib import Path

from rlcli.compat.renderer_choice import resolve_renderer
from rlcli.compat.run_hooks import install_dpo_hooks
from rlcli.data.pairs import read_pairs
from rlcli.errors import RlcliError
from rlcli.flags import option, retune
from rlcli.recipes import base
from rlcli.recipes.base import Plan, Recipe
from rlcli.recipes.options import TrainOptions
from rlcli.recipes.preflight import check_model_arg, check_renderer
from rlcli.recipes.sl import chat_builder_config
from rlcli.runs.runner import metric_values

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
    init_checkpoint: str | None = option(
        None,
        "Start from this training state's weights (tinker://RUN/weights/NAME); it is the "
        "reference too.",
    )


@dataclass
class DPOPlan(Plan):
    dataset_path: str  # the pairs file the recipe reads (in the run folder)
    pairs: int
    batches_per_epoch: int
    dropped_per_epoch: int  # full batches only, as the cookbook's dataset


def load_pairs(opts: DPOOptions, run_dir: Path, stdin) -> list[dict]:
    """Every pair, validated (bad lines by number); a resumed run with nothing on stdin reuses
    the folder's copy (the cookbook's rows, which ``read_pairs`` reads too)."""
    return base.read_input(opts.dataset, run_dir / PAIRS_FILE, stdin, read_pairs)[0]


LOSS, MARGIN, ACCURACY = "dpo_loss", "margin", "accuracy"
NAMES = {"loss": LOSS, "margin": MARGIN, "accuracy": ACCURACY}


class DPO(Recipe):
    name = "dpo"
    options = DPOOptions
    help = (
        "Preference training (DPO) on chosen/rejected pairs, with the cookbook's DPO recipe; "
        "the reference is the base model."
    )
    show = {LOSS: "loss", MARGIN: "margin", ACCURACY: "acc"}

    def prepare(self, opts: DPOOptions, stdin=None, dry_run=False) -> tuple[DPOPlan, list[dict]]:
        """Validate the model, renderer and pairs, count the steps; writes nothing."""
        check_model_arg(opts.model)
        check_renderer(opts.renderer)
        run_dir = self.run_dir_of(opts)
        pairs = load_pairs(opts, run_dir, stdin)
        renderer, source, _ = resolve_renderer(opts.model, opts.renderer)
        batches = len(pairs) // opts.batch_size
        if batches == 0:
            raise RlcliError(
                f"--batch-size {opts.batch_size}: larger than the {len(pairs)} pairs; lower it"
            )
        plan = DPOPlan(
            run_dir=str(run_dir),
            dataset_path=str(run_dir / PAIRS_FILE),
            pairs=len(pairs),
            batches_per_epoch=batches,
            dropped_per_epoch=len(pairs) - batches * opts.batch_size,
            steps=base.capped(batches * opts.epochs, opts),
            renderer=renderer,
            renderer_source=source,
            resuming=base.resuming(run_dir),
        )
        return plan, pairs

    def check_server(self, server, opts: DPOOptions, plan: DPOPlan, report) -> str:
        server.check_checkpoint(opts.init_checkpoint, "--init-checkpoint", "training")
        return super().check_server(server, opts, plan, report)

    def resolved_fields(self, opts: DPOOptions, plan: DPOPlan, base_url: str) -> dict:
        return {"dataset": plan.dataset_path}

    def commit(self, opts: DPOOptions, plan: DPOPlan, pairs: list[dict]) -> None:
        """Write the pairs into the run folder (the recipe reads them there; unchanged on a
        resume)."""
        base.keep_lines(Path(plan.dataset_path), pairs)

    def describe(self, plan: DPOPlan, served_by: str = "") -> str:
        return f"{plan.pairs} pairs, {plan.steps} steps"

    def cookbook_config(self, spec: dict):
        from tinker_cookbook.preference import train_dpo
        from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
        from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl

        opts, plan = spec["options"], spec["plan"]
        builder = DPODatasetBuilderFromComparisons(
            comparison_builder=ComparisonBuilderFromJsonl(train_path=plan["dataset_path"]),
            common_config=chat_builder_config(spec),
        )
        return train_dpo.Config(
            **self.cookbook_kwargs(spec),
            dataset_builder=builder,
            load_checkpoint_path=opts.get("init_checkpoint"),
            lr_schedule=opts["lr_schedule"],
            num_epochs=opts["epochs"],
            dpo_beta=opts["beta"],
            eval_every=0,
            infrequent_eval_every=0,
            max_steps=opts["max_steps"],
        )

    def run_in_child(self, spec: dict) -> dict:
        from tinker_cookbook.preference import train_dpo

        config = self.cookbook_config(spec)
        install_dpo_hooks(spec["options"]["seed"], spec["plan"]["batches_per_epoch"])
        train_dpo.main(config)
        series = metric_values(Path(config.log_path), LOSS, MARGIN, ACCURACY)
        return base.summary_of(config.log_path, **base.first_last(series, NAMES))

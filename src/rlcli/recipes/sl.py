"""Supervised fine-tuning on chat JSONL: rlcli's layer over the cookbook's ``supervised.train``.

``prepare`` validates the data and plans the run before any server work; ``cookbook_config``
builds the recipe's ``chz`` config from the saved spec; ``run_in_child`` runs the recipe (in the
child process) and writes the end-of-run summary, with the held-out loss when asked for.
The pedagogical version of the loop itself is the cookbook's ``recipes/sl_loop.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rlcli.compat.packing import SEGMENT_KEY
from rlcli.compat.renderer_choice import for_tool_data, resolve_renderer
from rlcli.compat.run_hooks import install_grad_accum, install_lr_warmup, install_packing
from rlcli.data import tables
from rlcli.data.chat import read_conversations
from rlcli.errors import RlcliError
from rlcli.flags import option, retune
from rlcli.recipes import base
from rlcli.recipes.base import Plan, Recipe
from rlcli.recipes.options import TrainOptions
from rlcli.recipes.preflight import check_model_arg, check_renderer
from rlcli.runs.runner import metric_values

DATASET_FILE = "dataset.jsonl"
SCHEDULES = ("constant", "linear", "cosine")  # the cookbook's LRSchedule
TRAIN_ON = {"all-assistant": "all_assistant_messages", "last": "last_assistant_message"}


@dataclass(kw_only=True)
class SLOptions(TrainOptions):
    dataset: str = option(
        help="Chat JSONL ({'messages': [...]}), - for stdin, a parquet/arrow file or folder, "
        "or a Hugging Face dataset id (NAME or NAME:SPLIT; rows with a messages column)."
    )
    batch_size: int = option(8, "Conversations per forward_backward request.", min=1)
    grad_accum: int = option(
        1,
        "Gradient accumulation: each step sums the gradients of N requests of --batch-size "
        "conversations, then one optimizer step (an effective batch of N x --batch-size).",
        min=1,
    )
    lr: float = retune(TrainOptions, "lr", 1e-4)
    lr_schedule: str = option(
        "linear",
        "How the learning rate falls after warmup: to 0 in a line or a cosine, or not at all.",
        choices=SCHEDULES,
    )
    warmup_steps: int = option(
        0, "Raise the learning rate linearly to --lr over the first N steps.", min=0
    )
    train_on: str = option(
        "all-assistant",
        "Tokens with a loss: every assistant message, or the last one only.",
        choices=tuple(TRAIN_ON),
    )
    max_length: int = option(2048, "Truncate conversations to this many tokens.", min=8)
    pack: bool = option(
        False,
        "Pack short conversations into sequences of up to --max-length tokens, each attending "
        "to itself only (fewer, fuller rows; the same loss). rlcli's torch server only.",
    )
    epochs: int = option(1, "Passes over the data.", min=1)
    test_size: float = option(0.0, "Fraction of conversations held out (0-1).", min=0, lt=1)
    eval_every: int = option(
        0, "Held-out loss every N steps too (needs --test-size; 0: at the end only).", min=0
    )
    init_checkpoint: str | None = option(
        None, "Start from this training state's weights (tinker://RUN/weights/NAME)."
    )


@dataclass
class SLPlan(Plan):
    dataset_path: str
    examples: int
    held_out: int
    train_examples: int
    batches_per_epoch: int
    dropped_per_epoch: int  # the cookbook trains full batches only
    # Counted for dry runs only (the recipe renders everything again); None otherwise, or
    # when the tokenizer cannot be loaded here (an offline hub id). Split as the recipe
    # splits (its shuffle with --seed, then the first held_out conversations).
    tokens_per_epoch: int | None
    held_out_tokens: int | None


def load_dataset(opts: SLOptions, run_dir: Path, stdin) -> tuple[list[dict], Path]:
    """The validated conversations and the file the recipe will read (``base.read_input``:
    stdin and tables are kept in the run folder by ``commit``)."""
    kept = run_dir / DATASET_FILE
    if tables.is_table(opts.dataset):  # read through `datasets`, kept like stdin
        rows, source = tables.read_rows(opts.dataset)
        lines = (json.dumps(row, ensure_ascii=False, default=str) for row in rows)
        return read_conversations(lines, f"--dataset {source} (row N is line N)"), kept
    return base.read_input(opts.dataset, kept, stdin, read_conversations)


class SL(Recipe):
    name = "sl"
    options = SLOptions
    help = "Supervised fine-tuning on chat conversations, with the cookbook's supervised recipe."
    # metrics.jsonl key -> label on the progress line (test/nll: the steps --eval-every measures)
    show = {"train_mean_nll": "loss", "test/nll": "held-out", "learning_rate": "lr"}

    def prepare(self, opts: SLOptions, stdin=None, dry_run=False) -> tuple[SLPlan, list[dict]]:
        """Validate the model, renderer and data, count what will be trained; writes nothing."""
        check_model_arg(opts.model)
        check_renderer(opts.renderer)
        if opts.eval_every and not opts.test_size:
            raise RlcliError(
                f"--eval-every {opts.eval_every}: hold some conversations out with --test-size"
            )
        run_dir = self.run_dir_of(opts)
        conversations, dataset_path = load_dataset(opts, run_dir, stdin)
        renderer, source, tokenizer = resolve_renderer(opts.model, opts.renderer)
        with_tools = next((c for c in conversations if _has_tools(c)), None)
        if with_tools and not opts.renderer and tokenizer is not None:
            renderer, source = for_tool_data(renderer, source, tokenizer, with_tools)
        held_out = math.ceil(opts.test_size * len(conversations)) if opts.test_size else 0
        if held_out >= len(conversations):
            raise RlcliError(
                f"--test-size {opts.test_size}: holds out all {len(conversations)} conversations"
            )
        train_examples = len(conversations) - held_out
        per_step = opts.batch_size * opts.grad_accum
        batches = train_examples // per_step
        if batches == 0:
            times = f" x --grad-accum {opts.grad_accum}" if opts.grad_accum > 1 else ""
            raise RlcliError(
                f"--batch-size {opts.batch_size}{times}: larger than the {train_examples} "
                "training conversations; lower it"
            )
        steps = base.capped(batches * opts.epochs, opts)
        if opts.warmup_steps >= steps:
            raise RlcliError(
                f"--warmup-steps {opts.warmup_steps}: the run has {steps} steps; warm up for fewer"
            )
        tokens = (None, None)
        if dry_run:
            tokens = _count_tokens(
                conversations, held_out, renderer, tokenizer, opts.max_length, opts.seed
            )
        plan = SLPlan(
            run_dir=str(run_dir),
            dataset_path=str(dataset_path),
            examples=len(conversations),
            held_out=held_out,
            train_examples=train_examples,
            batches_per_epoch=batches,
            dropped_per_epoch=train_examples - batches * per_step,
            steps=steps,
            renderer=renderer,
            renderer_source=source,
            tokens_per_epoch=tokens[0],
            held_out_tokens=tokens[1],
            resuming=base.resuming(run_dir),
        )
        return plan, conversations

    def check_server(self, server, opts: SLOptions, plan: SLPlan, report) -> str:
        server.check_checkpoint(opts.init_checkpoint, "--init-checkpoint", "training")
        if opts.pack:
            server.check_packing(SEGMENT_KEY)
        return super().check_server(server, opts, plan, report)

    def resolved_fields(self, opts: SLOptions, plan: SLPlan, base_url: str) -> dict:
        return {"dataset": plan.dataset_path}

    def commit(self, opts: SLOptions, plan: SLPlan, conversations: list[dict]) -> None:
        """Keep stdin's (or a table's) conversations in the run folder for the recipe and for
        resume; a JSONL file is read where it is."""
        kept = Path(plan.dataset_path)
        if kept.name == DATASET_FILE and kept.parent == Path(plan.run_dir):
            base.keep_lines(kept, conversations)

    def describe(self, plan: SLPlan, served_by: str = "") -> str:
        held_out = f", {plan.held_out} held out" if plan.held_out else ""
        return f"{plan.train_examples} conversations, {plan.steps} steps{held_out}"

    def cookbook_config(self, spec: dict):
        from tinker_cookbook.supervised import train

        from rlcli.compat.chat_messages import ChatFileBuilder

        opts, plan = spec["options"], spec["plan"]
        builder = ChatFileBuilder(
            file_path=plan["dataset_path"],
            test_size=plan["held_out"],
            shuffle_seed=opts["seed"],
            common_config=chat_builder_config(
                spec,
                train_on_what=TRAIN_ON[opts["train_on"]],
                # a step's batch; run_hooks.install_grad_accum splits it into the requests
                batch_size=opts["batch_size"] * opts.get("grad_accum", 1),
            ),
        )
        return train.Config(
            **self.cookbook_kwargs(spec),
            dataset_builder=builder,
            load_checkpoint_path=opts.get("init_checkpoint"),
            lr_schedule=opts["lr_schedule"],  # after warmup: run_hooks.install_lr_warmup
            num_epochs=opts["epochs"],
            eval_every=opts["eval_every"],  # and once more at the end (run_in_child)
            infrequent_eval_every=0,
            max_steps=opts["max_steps"],
        )

    def run_in_child(self, spec: dict) -> dict:
        """Run the recipe, then measure the held-out loss on the final weights."""
        import asyncio

        import tinker
        from tinker_cookbook.supervised import train
        from tinker_cookbook.supervised.nll_evaluator import NLLEvaluator

        config = self.cookbook_config(spec)
        install_lr_warmup(spec["options"]["warmup_steps"])
        install_grad_accum(spec["options"].get("grad_accum", 1))
        if spec["options"].get("pack"):
            install_packing(spec["options"]["max_length"])
        asyncio.run(train.main(config))
        losses = metric_values(Path(config.log_path), "train_mean_nll")["train_mean_nll"]
        summary = base.summary_of(
            config.log_path, final_loss=(losses or [None])[-1], first_loss=(losses or [None])[0]
        )
        if spec["plan"]["held_out"] and summary["state_path"]:
            _, test_ds = config.dataset_builder()
            service = tinker.ServiceClient(base_url=config.base_url)
            trainer = service.create_training_client_from_state(summary["state_path"]).result()
            metrics = asyncio.run(NLLEvaluator.from_dataset(test_ds)(trainer))
            summary["held_out_loss"] = metrics["test/nll"]
        return summary


def _has_tools(conversation: dict) -> bool:
    return bool(conversation.get("tools")) or any(
        m.get("tool_calls") for m in conversation["messages"]
    )


def _count_tokens(conversations, held_out, renderer_name, tokenizer, max_length, seed):
    """(training tokens per epoch, held-out tokens), after truncation to ``max_length``."""
    if tokenizer is None:
        return None, None
    import datasets
    from tinker_cookbook import renderers
    from tinker_cookbook.supervised.data import conversation_to_datum

    from rlcli.compat.chat_messages import to_cookbook

    renderer = renderers.get_renderer(renderer_name, tokenizer)
    lengths = [
        conversation_to_datum(to_cookbook(c, renderer), renderer, max_length).model_input.length
        for c in conversations
    ]
    # The recipe's order: ChatFileBuilder shuffles with the seed, then splits.
    order = datasets.Dataset.from_dict({"i": range(len(lengths))}).shuffle(seed=seed)["i"]
    test = sum(lengths[i] for i in order[:held_out])
    return sum(lengths) - test, test


def chat_builder_config(spec: dict, **extra):
    """The cookbook's ``ChatDatasetBuilderCommonConfig`` of a chat-data recipe (sl, dpo)."""
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    return ChatDatasetBuilderCommonConfig(
        **{**base.dataset_kwargs(spec, "max_length", "batch_size"), **extra}
    )

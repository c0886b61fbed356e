"""Supervised fine-tuning on chat JSONL: rlcli's layer over the cookbook's ``supervised.train``.

``prepare`` validates the data and plans the run before any server work; ``cookbook_config``
builds the recipe's ``chz`` config from the saved spec; ``run_in_child`` runs the recipe (in the
child process) and writes the end-of-run summary, with the held-out loss when asked for.
The pedagogical version of the loop itself is the cookbook's ``recipes/sl_loop.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rlcli.data.chat import read_conversations, stdin_text
from rlcli.errors import RlcliError
from rlcli.recipes.options import TrainOptions, option, resume_command, retune, saved
from rlcli.runs.runner import default_run_dir, metric_values

DATASET_FILE = "dataset.jsonl"
SCHEDULES = ("constant", "linear", "cosine")  # the cookbook's LRSchedule
TRAIN_ON = {"all-assistant": "all_assistant_messages", "last": "last_assistant_message"}


@dataclass(kw_only=True)
class SLOptions(TrainOptions):
    dataset: str = option(
        help="Chat JSONL ({'messages': [...]}), - for stdin, a parquet/arrow file or folder, "
        "or a Hugging Face dataset id (NAME or NAME:SPLIT; rows with a messages column)."
    )
    batch_size: int = option(8, "Conversations per step.", min=1)
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
    epochs: int = option(1, "Passes over the data.", min=1)
    test_size: float = option(0.0, "Fraction of conversations held out (0-1).", min=0, lt=1)
    eval_every: int = option(
        0, "Held-out loss every N steps too (needs --test-size; 0: at the end only).", min=0
    )


@dataclass
class SLPlan:
    run_dir: str
    dataset_path: str
    examples: int
    held_out: int
    train_examples: int
    batches_per_epoch: int
    dropped_per_epoch: int  # the cookbook trains full batches only
    steps: int
    renderer: str
    renderer_source: str
    # Counted for dry runs only (the recipe renders everything again); None otherwise, or
    # when the tokenizer cannot be loaded here (an offline hub id). Split as the recipe
    # splits (its shuffle with --seed, then the first held_out conversations).
    tokens_per_epoch: int | None
    held_out_tokens: int | None
    resuming: bool


def run_dir_of(opts: SLOptions) -> Path:
    return Path(opts.log_path).expanduser() if opts.log_path else default_run_dir("sl")


def load_dataset(opts: SLOptions, run_dir: Path, stdin) -> tuple[list[dict], Path]:
    """The validated conversations and the file the recipe will read.

    Stdin is validated in memory only; ``keep_stdin`` writes it into the run folder once every
    check has passed, so a bad stream or a refused run leaves nothing behind. A resumed run
    with nothing on stdin reuses that copy.
    """
    from rlcli.data import tables

    kept = run_dir / DATASET_FILE
    if tables.is_table(opts.dataset):  # read through `datasets`, kept like stdin
        rows, source = tables.read_rows(opts.dataset)
        lines = (json.dumps(row, ensure_ascii=False, default=str) for row in rows)
        return read_conversations(lines, f"--dataset {source} (row N is line N)"), kept
    if opts.dataset == "-":
        if kept.exists() and (stdin is None or stdin.isatty()):  # a resume: the kept copy
            text = ""
        else:
            text = stdin_text(stdin, "--dataset")
        if not text.strip() and kept.exists():
            return read_conversations(kept.open(), str(kept)), kept
        return read_conversations(text.splitlines(), "stdin"), kept
    path = Path(opts.dataset).expanduser()
    if not path.is_file():
        raise RlcliError(f"--dataset {opts.dataset}: no such file")
    with path.open(encoding="utf-8", errors="replace") as f:
        return read_conversations(f, str(path)), path.resolve()


def keep_stdin(opts: SLOptions, plan: SLPlan, conversations: list[dict]) -> None:
    """Write stdin's (or a table's) conversations into the run folder (atomically) for the
    recipe and resume."""
    kept = Path(plan.dataset_path)
    if kept.name != DATASET_FILE or kept.parent != Path(plan.run_dir):
        return  # a JSONL file the recipe reads where it is
    if kept.exists() and _same_rows(kept, conversations):
        return
    kept.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=kept.parent, prefix=".dataset.")
    with os.fdopen(fd, "w") as f:
        f.writelines(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations)
    os.replace(tmp, kept)


def _same_rows(path: Path, conversations: list[dict]) -> bool:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()] == conversations


def prepare(opts: SLOptions, stdin=None, dry_run: bool = False) -> tuple[SLPlan, list[dict]]:
    """Validate the model, renderer and data, count what will be trained; writes nothing."""
    from rlcli.compat.renderer_choice import resolve_renderer
    from rlcli.recipes.preflight import check_model_arg, check_renderer

    check_model_arg(opts.model)
    check_renderer(opts.renderer)
    if opts.eval_every and not opts.test_size:
        raise RlcliError(
            f"--eval-every {opts.eval_every}: hold some conversations out with --test-size"
        )
    run_dir = run_dir_of(opts)
    resuming = (run_dir / "checkpoints.jsonl").exists()
    conversations, dataset_path = load_dataset(opts, run_dir, stdin)
    renderer, source, tokenizer = resolve_renderer(opts.model, opts.renderer)
    held_out = math.ceil(opts.test_size * len(conversations)) if opts.test_size else 0
    if held_out >= len(conversations):
        raise RlcliError(
            f"--test-size {opts.test_size}: holds out all {len(conversations)} conversations"
        )
    train_examples = len(conversations) - held_out
    batches = train_examples // opts.batch_size
    if batches == 0:
        raise RlcliError(
            f"--batch-size {opts.batch_size}: larger than the {train_examples} training "
            "conversations; lower it"
        )
    steps = batches * opts.epochs
    if opts.max_steps is not None:
        steps = min(steps, opts.max_steps)
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
        dropped_per_epoch=train_examples - batches * opts.batch_size,
        steps=steps,
        renderer=renderer,
        renderer_source=source,
        tokens_per_epoch=tokens[0],
        held_out_tokens=tokens[1],
        resuming=resuming,
    )
    return plan, conversations


def _count_tokens(conversations, held_out, renderer_name, tokenizer, max_length, seed):
    """(training tokens per epoch, held-out tokens), after truncation to ``max_length``."""
    if tokenizer is None:
        return None, None
    import datasets
    from tinker_cookbook import renderers
    from tinker_cookbook.supervised.data import conversation_to_datum

    renderer = renderers.get_renderer(renderer_name, tokenizer)
    lengths = [
        conversation_to_datum(c["messages"], renderer, max_length).model_input.length
        for c in conversations
    ]
    # The recipe's order: FromConversationFileBuilder shuffles with the seed, then splits.
    order = datasets.Dataset.from_dict({"i": range(len(lengths))}).shuffle(seed=seed)["i"]
    test = sum(lengths[i] for i in order[:held_out])
    return sum(lengths) - test, test


def resolved(opts: SLOptions, plan: SLPlan, base_url: str) -> SLOptions:
    """The options as the run uses them: the server, the renderer and the data file named."""
    return dataclasses.replace(
        opts, base_url=base_url, renderer=plan.renderer, dataset=plan.dataset_path,
        log_path=plan.run_dir,
    )  # fmt: skip


def spec(opts: SLOptions, plan: SLPlan) -> dict:
    """What the child process builds the recipe from (``opts``: resolved)."""
    return {"recipe": "sl", "options": saved(opts), "plan": asdict(plan)}


def cookbook_config(spec: dict):
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    opts, plan = spec["options"], spec["plan"]
    builder = FromConversationFileBuilder(
        file_path=plan["dataset_path"],
        test_size=plan["held_out"],
        shuffle_seed=opts["seed"],
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=opts["model"],
            renderer_name=plan["renderer"],
            max_length=opts["max_length"],
            batch_size=opts["batch_size"],
            train_on_what=TRAIN_ON[opts["train_on"]],
        ),
    )
    return train.Config(
        log_path=plan["run_dir"],
        model_name=opts["model"],
        recipe_name="rlcli_sl",
        renderer_name=plan["renderer"],
        dataset_builder=builder,
        learning_rate=opts["lr"],
        lr_schedule=opts["lr_schedule"],  # after warmup: run_hooks.install_lr_warmup
        num_epochs=opts["epochs"],
        lora_rank=opts["lora_rank"],
        base_url=opts["base_url"],
        save_every=opts["save_every"],
        eval_every=opts["eval_every"],  # and once more at the end (run_in_child)
        infrequent_eval_every=0,
        max_steps=opts["max_steps"],
        wandb_project=opts["wandb_project"],
        wandb_name=opts["wandb_name"],
    )


def run_in_child(spec: dict) -> dict:
    """Run the recipe, then measure the held-out loss on the final weights."""
    import asyncio

    import tinker
    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.nll_evaluator import NLLEvaluator

    from rlcli.compat.run_hooks import install_lr_warmup

    config = cookbook_config(spec)
    install_lr_warmup(spec["options"]["warmup_steps"])
    asyncio.run(train.main(config))
    last = checkpoint_utils.get_last_checkpoint(config.log_path)
    losses = metric_values(Path(config.log_path), "train_mean_nll")["train_mean_nll"]
    summary = {
        "run_dir": config.log_path,
        "state_path": last.state_path if last else None,
        "sampler_path": last.get("sampler_path") if last else None,
        "final_loss": (losses or [None])[-1],
        "first_loss": (losses or [None])[0],
    }
    if spec["plan"]["held_out"] and last is not None:
        _, test_ds = config.dataset_builder()
        service = tinker.ServiceClient(base_url=config.base_url)
        trainer = service.create_training_client_from_state(last.state_path).result()
        metrics = asyncio.run(NLLEvaluator.from_dataset(test_ds)(trainer))
        summary["held_out_loss"] = metrics["test/nll"]
    return summary


COMMAND = "rlcli train sl"
# metrics.jsonl key -> label on the progress line (test/nll: the steps --eval-every measures)
SHOW = {"train_mean_nll": "loss", "test/nll": "held-out", "learning_rate": "lr"}
TOKENS_KEY = "num_tokens"


def describe(plan: SLPlan, served_by: str = "") -> str:
    held_out = f", {plan.held_out} held out" if plan.held_out else ""
    return f"{plan.train_examples} conversations, {plan.steps} steps{held_out}"


def check_server(server, opts: SLOptions, plan: SLPlan) -> str:
    """Nothing beyond the shared checks; returns the backend for the start line."""
    return server.backend or "unknown"


def commit(opts: SLOptions, plan: SLPlan, conversations: list[dict]) -> None:
    keep_stdin(opts, plan, conversations)


def resume_hint(opts: SLOptions, plan: SLPlan) -> str:
    return resume_command(COMMAND, plan.run_dir)

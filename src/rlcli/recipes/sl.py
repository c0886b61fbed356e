"""Supervised fine-tuning on chat JSONL: rlcli's layer over the cookbook's ``supervised.train``.

``prepare`` validates the data and plans the run before any server work; ``cookbook_config``
builds the recipe's ``chz`` config from the saved spec; ``run_in_child`` runs the recipe (in the
child process) and writes the end-of-run summary, with the held-out loss when asked for.
The pedagogical version of the loop itself is the cookbook's ``recipes/sl_loop.py``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rlcli.data.chat import read_conversations
from rlcli.errors import RlcliError
from rlcli.recipes.runner import check_minimums, default_run_dir, metric_values, resume_command

DATASET_FILE = "dataset.jsonl"


@dataclass
class SLOptions:
    dataset: str
    model: str
    base_url: str = "http://localhost:8000"
    renderer: str | None = None
    batch_size: int = 8
    lr: float = 1e-4
    max_length: int = 2048
    epochs: int = 1
    lora_rank: int = 32
    save_every: int = 20
    test_size: float = 0.0
    log_path: str | None = None
    max_steps: int | None = None


@dataclass
class SLPlan:
    run_dir: str
    dataset_path: str
    examples: int
    held_out: int
    train_examples: int
    batches_per_epoch: int
    steps: int
    renderer: str
    renderer_source: str
    # Counted for dry runs only (the recipe renders everything again); None otherwise, or
    # when the tokenizer cannot be loaded here (an offline hub id).
    tokens: int | None
    resuming: bool


def check_options(opts: SLOptions) -> None:
    check_minimums(
        (
            ("--batch-size", opts.batch_size, 1),
            ("--epochs", opts.epochs, 1),
            ("--lora-rank", opts.lora_rank, 1),
            ("--max-length", opts.max_length, 8),
            ("--save-every", opts.save_every, 0),
        )
    )
    if not 0 <= opts.test_size < 1:
        raise RlcliError(f"--test-size {opts.test_size}: a fraction in [0, 1)")
    if not opts.lr > 0:
        raise RlcliError(f"--lr {opts.lr}: must be positive")


def load_dataset(opts: SLOptions, run_dir: Path, stdin, keep: bool) -> tuple[list[dict], Path]:
    """The validated conversations and the file the recipe will read.

    Stdin is validated in memory and only then written into the run folder (atomically; not at
    all when ``keep`` is false), so a bad stream leaves nothing behind; a resumed run with
    nothing on stdin reuses that copy.
    """
    kept = run_dir / DATASET_FILE
    if opts.dataset == "-":
        text = "" if stdin is None or stdin.isatty() else stdin.read()
        if not text.strip() and kept.exists():
            return read_conversations(kept.open(), str(kept)), kept
        conversations = read_conversations(text.splitlines(), "stdin")
        if not keep:
            return conversations, kept
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".dataset.")
        with os.fdopen(fd, "w") as f:
            f.writelines(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations)
        os.replace(tmp, kept)
        return conversations, kept
    path = Path(opts.dataset).expanduser()
    if not path.is_file():
        raise RlcliError(f"--dataset {opts.dataset}: no such file")
    with path.open(encoding="utf-8", errors="replace") as f:
        return read_conversations(f, str(path)), path.resolve()


def prepare(opts: SLOptions, stdin=None, dry_run: bool = False) -> SLPlan:
    """Validate flags and data, resolve the renderer, count what will be trained."""
    from rlcli.compat import resolve_renderer

    check_options(opts)
    run_dir = Path(opts.log_path).expanduser() if opts.log_path else default_run_dir("sl")
    resuming = (run_dir / "checkpoints.jsonl").exists()
    conversations, dataset_path = load_dataset(opts, run_dir, stdin, keep=not dry_run)
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
    tokens = None
    if dry_run:
        tokens = _count_tokens(conversations, renderer, tokenizer, opts.max_length)
    return SLPlan(
        run_dir=str(run_dir),
        dataset_path=str(dataset_path),
        examples=len(conversations),
        held_out=held_out,
        train_examples=train_examples,
        batches_per_epoch=batches,
        steps=steps,
        renderer=renderer,
        renderer_source=source,
        tokens=tokens,
        resuming=resuming,
    )


def _count_tokens(conversations, renderer_name, tokenizer, max_length) -> int | None:
    if tokenizer is None:
        return None
    from tinker_cookbook import renderers
    from tinker_cookbook.supervised.data import conversation_to_datum

    renderer = renderers.get_renderer(renderer_name, tokenizer)
    return sum(
        conversation_to_datum(c["messages"], renderer, max_length).model_input.length
        for c in conversations
    )


def spec(opts: SLOptions, plan: SLPlan) -> dict:
    return {"recipe": "sl", "options": asdict(opts), "plan": asdict(plan)}


def cookbook_config(spec: dict):
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    opts, plan = spec["options"], spec["plan"]
    builder = FromConversationFileBuilder(
        file_path=plan["dataset_path"],
        test_size=plan["held_out"],
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=opts["model"],
            renderer_name=plan["renderer"],
            max_length=opts["max_length"],
            batch_size=opts["batch_size"],
        ),
    )
    return train.Config(
        log_path=plan["run_dir"],
        model_name=opts["model"],
        recipe_name="rlcli_sl",
        renderer_name=plan["renderer"],
        dataset_builder=builder,
        learning_rate=opts["lr"],
        num_epochs=opts["epochs"],
        lora_rank=opts["lora_rank"],
        base_url=opts["base_url"],
        save_every=opts["save_every"],
        eval_every=0,  # the held-out loss is measured once, at the end (run_in_child)
        infrequent_eval_every=0,
        max_steps=opts["max_steps"],
    )


def run_in_child(spec: dict) -> dict:
    """Run the recipe, then measure the held-out loss on the final weights."""
    import asyncio

    import tinker
    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.nll_evaluator import NLLEvaluator

    config = cookbook_config(spec)
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
        trainer = service.create_training_client_from_state(last.state_path)
        metrics = asyncio.run(NLLEvaluator.from_dataset(test_ds)(trainer))
        summary["held_out_loss"] = metrics["test/nll"]
    return summary


def resume_hint(opts: SLOptions, plan: SLPlan) -> str:
    line = resume_command("rlcli train sl", opts, plan.run_dir)
    return line + (f"  # stdin data is kept in {plan.run_dir}" if opts.dataset == "-" else "")

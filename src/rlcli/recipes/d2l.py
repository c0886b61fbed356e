"""``rlcli train d2l``: train a doc-to-LoRA hypernetwork on (document, question, answer)
examples, so that internalizing a document later takes one forward pass.

No cookbook recipe exists for this, so the loop is ours and short: each step sends a batch of
examples to the server's hypernetwork routes (``client/d2l.py`` -> ``server/http/d2l.py``),
which read each document with the frozen base model, make its LoRA with the hypernetwork and
score the answer with it (cross-entropy; ``--l1`` adds the reference's penalty on the
generated weights). It writes what the cookbook's loops write (``metrics.jsonl``, one row per
step; ``checkpoints.jsonl``, one row per save, ``state_path`` naming the hypernetwork's
``tinker://<id>/hypernet_weights/<name>``), so plan, progress, ``runs``, cancel and resume work
as for every train command. A resume loads the last checkpoint (weights and optimizer) under
the same id and continues with the next batch of the same seeded order.

``--dataset synthetic:N`` generates N one-fact documents offline (``data/d2l_examples.py``).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from rlcli.data.d2l_examples import SYNTHETIC, read_examples, split_count, synthetic_haystacks
from rlcli.errors import RlcliError
from rlcli.flags import option, retune
from rlcli.recipes import base
from rlcli.recipes.base import Plan, Recipe
from rlcli.recipes.options import TrainOptions
from rlcli.runs.folder import CANCEL, CHECKPOINTS_FILE, METRICS_FILE

EXAMPLES_FILE = "examples.jsonl"  # the training examples, in the run folder
RENDERER = "chat_template"  # the server renders questions with the base model's template


@dataclass(kw_only=True)
class D2LOptions(TrainOptions):
    dataset: str = option(
        help='JSONL of {"document", "question", "answer"}, {"document", "qa": [{"question", '
        '"answer"}, ...]} or {"document"} (questions written by internalize\'s templates, up to '
        "8); - for stdin; synthetic:N for N generated one-fact documents."
    )
    eval_dataset: str | None = option(
        None, "Held-out documents (same format): their answer loss is reported at the end."
    )
    batch_size: int = option(8, "Examples per step.", min=1)
    epochs: int = option(1, "Passes over the examples.", min=1)
    lr: float = retune(TrainOptions, "lr", 1e-3)
    lora_rank: int = retune(TrainOptions, "lora_rank", 8)
    latent: int = option(64, "Width of the hypernetwork's Perceiver and head input.", min=4)
    chunk_tokens: int = option(512, "A document is read in chunks of this many tokens.", min=8)
    max_chunks: int = option(
        8, "The longest document, in chunks (one LoRA rank block each).", min=1
    )
    lora_layers: int = option(
        0,
        "Adapt only the last N layers (0: all): training's backward pass stops below them, "
        "several times cheaper on a CPU.",
        min=0,
    )
    l1: float = option(0.0, "L1 penalty on the generated LoRA weights.", min=0)
    split_chunks: int = option(
        8,
        "Training reads each document as 1..N pieces of about equal length (one half the "
        "time, else 2..N; none under 25 tokens), as the reference trains, so a long "
        "document's chunk LoRAs add up to the answer; 1: as internalizing reads it.",
        min=1,
    )
    filler: int = option(
        0,
        "synthetic:N only: each fact hidden among 0..N filler sentences, drawn per document "
        "(a haystack; 64 is about one 512-token chunk).",
        min=0,
    )
    filler_ramp: float = option(
        0.0,
        "synthetic:N with --filler: the most filler grows from 0 to --filler over this share "
        "of the documents, which the first epoch reads in order (a curriculum); 0: none.",
        min=0,
    )
    init_checkpoint: str | None = option(
        None,
        "Start from this hypernetwork (tinker://ID/hypernet_weights/NAME: its weights, its "
        "optimizer and its shape, which win over --lora-rank, --latent and the rest), e.g. one "
        "trained on bare facts, then taught haystacks (docs/d2l.md).",
    )


@dataclass
class D2LPlan(Plan):
    dataset_path: str  # the examples the run reads (in the run folder)
    examples: int
    eval_examples: int
    batches_per_epoch: int


def load_examples(opts: D2LOptions, run_dir: Path, stdin) -> list[dict]:
    if opts.dataset.startswith(SYNTHETIC):
        count = opts.dataset.removeprefix(SYNTHETIC)
        if not count.isdigit() or int(count) < 1:
            raise RlcliError(f"--dataset {opts.dataset}: synthetic:N takes a count N >= 1")
        return synthetic_haystacks(
            int(count), seed=opts.seed, most=opts.filler, ramp=opts.filler_ramp
        )
    return base.read_input(opts.dataset, run_dir / EXAMPLES_FILE, stdin, read_examples)[0]


def load_eval(opts: D2LOptions) -> list[dict]:
    if not opts.eval_dataset:
        return []
    if opts.eval_dataset.startswith(SYNTHETIC):
        count = opts.eval_dataset.removeprefix(SYNTHETIC)
        if not count.isdigit() or int(count) < 1:
            raise RlcliError(f"--eval-dataset {opts.eval_dataset}: synthetic:N takes N >= 1")
        # another seed than training's: held-out documents
        return synthetic_haystacks(int(count), seed=opts.seed + 10_007, most=opts.filler)
    path = Path(opts.eval_dataset).expanduser()
    if not path.is_file():
        raise RlcliError(f"--eval-dataset {opts.eval_dataset}: no such file")
    with path.open(encoding="utf-8", errors="replace") as f:
        return read_examples(f, str(path))


class D2L(Recipe):
    name = "d2l"
    options = D2LOptions
    help = (
        "Train a doc-to-LoRA hypernetwork on documents with questions and answers (rlcli's "
        "server); then rlcli internalize DOC --hypernet PATH makes a LoRA in one pass."
    )
    show = {"loss": "loss", "l1": "l1"}
    tokens_key = "answer_tokens"

    def prepare(self, opts: D2LOptions, stdin=None, dry_run=False) -> tuple[D2LPlan, dict]:
        from rlcli.recipes.preflight import check_model_arg

        check_model_arg(opts.model)
        if opts.filler_ramp > 1:
            raise RlcliError(f"--filler-ramp {opts.filler_ramp}: a share of the documents, 0..1")
        if opts.init_checkpoint:
            from rlcli.client.d2l import check_hypernet_path

            check_hypernet_path(opts.init_checkpoint, "--init-checkpoint")
        run_dir = self.run_dir_of(opts)
        examples = load_examples(opts, run_dir, stdin)
        held_out = load_eval(opts)
        batches = len(examples) // opts.batch_size
        if batches == 0:
            raise RlcliError(
                f"--batch-size {opts.batch_size}: larger than the {len(examples)} examples; "
                "lower it"
            )
        plan = D2LPlan(
            run_dir=str(run_dir),
            steps=base.capped(batches * opts.epochs, opts),
            renderer=RENDERER,
            renderer_source="the base model's chat template, applied by the server",
            resuming=base.resuming(run_dir),
            dataset_path=str(run_dir / EXAMPLES_FILE),
            examples=len(examples),
            eval_examples=len(held_out),
            batches_per_epoch=batches,
        )
        return plan, {"examples": examples, "eval": held_out}

    def check_server(self, server, opts, plan, report) -> str:
        from rlcli.client.d2l import check_hosts_hypernets

        check_hosts_hypernets(server)
        return server.backend or "unknown"

    def resolved_fields(self, opts: D2LOptions, plan: D2LPlan, base_url: str) -> dict:
        return {"dataset": plan.dataset_path}

    def commit(self, opts: D2LOptions, plan: D2LPlan, data: dict) -> None:
        base.keep_lines(Path(plan.dataset_path), data["examples"])
        if data["eval"]:
            base.keep_lines(Path(plan.run_dir) / "eval_examples.jsonl", data["eval"])

    def describe(self, plan: D2LPlan, served_by: str = "") -> str:
        held = f", {plan.eval_examples} held out" if plan.eval_examples else ""
        return f"a hypernetwork on {plan.examples} examples{held}, {plan.steps} steps"

    def run_in_child(self, spec: dict) -> dict:
        return Loop(spec).run()


class Loop:
    """The training loop in the recipe's child: one server call per step."""

    def __init__(self, spec: dict) -> None:
        from rlcli.client.d2l import Hypernets

        self.opts, self.plan = spec["options"], spec["plan"]
        self.run_dir = Path(self.plan["run_dir"])
        with open(self.plan["dataset_path"]) as f:
            self.examples = read_examples(f, self.plan["dataset_path"])
        held = self.run_dir / "eval_examples.jsonl"
        self.held_out = read_examples(held.open(), str(held)) if held.exists() else []
        self.client = Hypernets(self.opts["base_url"])

    def batch(self, step: int) -> list[dict]:
        """Step ``step``'s examples: each epoch its own seeded order (the first in the
        documents' own under ``--filler-ramp``), full batches only, each document's split
        (``--split-chunks``) drawn from the step's seed."""
        per_epoch, size = self.plan["batches_per_epoch"], self.opts["batch_size"]
        epoch, index = divmod(step, per_epoch)
        order = list(range(len(self.examples)))
        if epoch or not self.opts.get("filler_ramp"):
            random.Random(self.opts["seed"] * 1_000_003 + epoch).shuffle(order)
        rows = [self.examples[i] for i in order[index * size : (index + 1) * size]]
        most = self.opts.get("split_chunks", 1)
        if most < 2:
            return rows
        rng = random.Random(self.opts["seed"] * 7_919 + step)
        return [dict(row, chunks=split_count(rng, most)) for row in rows]

    def start(self) -> tuple[str, int, list[dict]]:
        """The hypernetwork to train and the step to start at (a resume: the last save's)."""
        saved = _rows(self.run_dir / CHECKPOINTS_FILE)
        if saved:
            last = saved[-1]
            hypernet_id = last["state_path"].removeprefix("tinker://").split("/")[0]
            self.client.load(last["state_path"], hypernet_id=hypernet_id)
            return hypernet_id, int(last["batch"]), saved
        if self.opts["init_checkpoint"]:
            loaded = self.client.load(self.opts["init_checkpoint"])
            return loaded["hypernet_id"], 0, []
        created = self.client.create(
            self.opts["model"], seed=self.opts["seed"], rank=self.opts["lora_rank"],
            latent=self.opts["latent"], chunk_tokens=self.opts["chunk_tokens"],
            max_chunks=self.opts["max_chunks"], lora_layers=self.opts["lora_layers"],
        )  # fmt: skip
        return created["hypernet_id"], 0, []

    def run(self) -> dict:
        from rlcli.compat.run_hooks import RunCancelled

        hypernet_id, step, saved = self.start()
        total, every = self.plan["steps"], self.opts["save_every"]
        losses: list[float] = []
        try:
            while step < total:
                out = self.client.step(
                    hypernet_id, self.batch(step), self.opts["lr"], self.opts["l1"]
                )
                losses.append(out["loss"])
                _append(self.run_dir / METRICS_FILE, {"step": step, **out})
                step += 1
                done, cancelled = step == total, self._cancelled()
                if done or (every and step % every == 0) or cancelled:
                    saved.append(self._save(hypernet_id, step, cancelled and not done))
                if cancelled and not done:
                    error = RunCancelled(step - 1)
                    error.paths = {"state_path": saved[-1]["state_path"]}
                    raise error
            held = self._held_out_loss(hypernet_id)
        finally:
            self.client.remove(hypernet_id)
        last = saved[-1]["state_path"] if saved else None
        return {
            "run_dir": str(self.run_dir),
            "hypernet_path": last,
            "state_path": last,
            "sampler_path": None,
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "held_out_loss": held,
        }

    def _save(self, hypernet_id: str, step: int, cancelled: bool = False) -> dict:
        name = f"{step:06d}"
        path = self.client.save(hypernet_id, name)["path"]
        row = {"name": name, "batch": step, "state_path": path, "hypernet_path": path}
        if cancelled:
            row["cancelled"] = True
        _append(self.run_dir / CHECKPOINTS_FILE, row)
        return row

    def _held_out_loss(self, hypernet_id: str) -> float | None:
        if not self.held_out:
            return None
        size, total, weight = self.opts["batch_size"], 0.0, 0
        for i in range(0, len(self.held_out), size):
            out = self.client.step(
                hypernet_id, self.held_out[i : i + size], self.opts["lr"], train=False
            )
            total += out["loss"] * out["answer_tokens"]
            weight += out["answer_tokens"]
        return total / max(weight, 1)

    def _cancelled(self) -> bool:
        """``rlcli runs cancel`` asked this run to stop (its request names our parent)."""
        from rlcli.runs.runner import PARENT_PID_ENV

        try:
            request = json.loads((self.run_dir / CANCEL).read_text())
        except (OSError, ValueError):
            return False
        parent = os.environ.get(PARENT_PID_ENV)
        return isinstance(request, dict) and str(request.get("pid")) == parent


def _rows(path: Path) -> list[dict]:
    from rlcli.files.jsonl import read_jsonl  # invariant 12: whole lines only

    return read_jsonl(path)[0]


def _append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")

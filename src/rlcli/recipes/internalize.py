"""``rlcli internalize``: a document into a LoRA, so the model answers from it with an empty
context (per-document context distillation, Snell et al. 2022).

This module is the command's side. ``prepare`` reads the documents and the probes
(``--questions`` and templated ones, ``data/probes.py``), cuts the documents into chunks that
fit the window, keeps a ``--test-size`` share of the probes out, and plans; no server, no
writes. Questions the teacher writes (``--question-writer model``) need the server, so the
plan counts ``--n-questions`` a document and the child writes them when the run starts.
``commit`` writes the documents and probes into the run folder. What the recipe child then
does with them (the questions it writes, the teacher's targets, the training, the receipt) is
``internalize_child.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rlcli.data import documents as docs_mod
from rlcli.data import probes as probes_mod
from rlcli.errors import RlcliError
from rlcli.files import atomic
from rlcli.flags import option, retune
from rlcli.recipes import base, opsd
from rlcli.recipes.base import Plan, Recipe
from rlcli.recipes.internalize_child import DOCUMENTS_FILE, PROBES_FILE, run
from rlcli.recipes.options import TrainOptions
from rlcli.recipes.preflight import check_model_arg, check_renderer

STDIN_FILE = "stdin.txt"  # DOCUMENT - kept for resume
DEFAULT_CHUNK_TOKENS = 1024  # the default chunk, when the window allows it
TEMPLATE_TOKENS = 16  # what the teacher's prompt adds around chunk and question
# --epochs' default: 8 passes while they fit in STEP_BUDGET steps, else as many as fit, at
# least MIN_EPOCHS; --lr's: BASE_LR at 8 passes, raised to BASE_LR * 8 / passes at fewer.
# Training is most of a run's time and grew with the probes (a 20-fact document's 108 training
# probes: 112 steps at 8 passes, over 3 minutes of training alone on 2 CPU cores). On SmolLM2
# (docs/internalize.md) that document learned 20 of 20 facts at 4 passes and lr 2e-3, 19 at 8
# passes and 1e-3, but 13 at 4 passes and 1e-3: fewer passes need the higher rate.
DEFAULT_EPOCHS = 8
MIN_EPOCHS = 4
STEP_BUDGET = 56
BASE_LR = 1e-3
# --question-writer auto: the teacher writes the questions from this size up (parameters,
# estimated from its config), templates below it. SmolLM2-135M's own questions, measured
# (docs/internalize.md), are fewer and vaguer than its templates'.
WRITER_MIN_PARAMS = 1_000_000_000


@dataclass(kw_only=True)
class InternalizeOptions(TrainOptions):
    documents: list[str] = option(
        help="Documents: files, folders (every file in them), or - for stdin (--hypernet: one "
        "document).",
        argument=True,
    )
    model: str | None = option(
        None,
        "Base model: hub id or local folder (required; with --hypernet: the server's, checked "
        "when given).",
    )
    hypernet: str | None = option(
        None,
        "Make the adapter with one forward pass of a doc-to-LoRA hypernetwork instead of "
        "training: tinker://ID/hypernet_weights/NAME (rlcli train d2l; rlcli's own server "
        "only). Takes one document and only --session-key, --ttl, --pin, --model, --base-url, "
        "--json.",
    )
    session_key: str | None = option(
        None,
        "--hypernet: the same key returns the same adapter without recomputing it, whatever "
        "the text, and renews its TTL (default: none, each call makes a new adapter).",
    )
    ttl: int | None = option(
        None,
        "--hypernet: seconds an unused adapter lives (default: 86400, one day; each use of its "
        "--session-key renews it).",
        min=1,
    )
    pin: bool = option(False, "--hypernet: keep the adapter until deleted (no TTL).")
    questions: str | None = option(
        None,
        'Probes JSONL: {"question": ..., "answer": ...} (answer optional; "document": a path '
        'or index; "held_out": true keeps a row for the receipt).',
    )
    n_questions: int = option(
        60, "Probes written per document (0: only --questions); see --question-writer.", min=0
    )
    question_writer: str = option(
        "auto",
        "Who writes the --n-questions probes: templates (each sentence that names something, "
        "asked about, its text the reference), model (the teacher, from each chunk, when the "
        "run starts; no reference answers), auto (model for a teacher of 1B parameters or "
        "more, else templates).",
        choices=("auto", "templates", "model"),
    )
    test_size: float = option(
        0.2, "Share of each document's probes held out for the receipt, never trained on.",
        min=0, lt=1,
    )  # fmt: skip
    teacher: str | None = option(
        None, "Teacher base model on the same server, same tokenizer (default: --model)."
    )
    targets: str = option(
        "auto",
        "What the student learns: auto (reference answers mixed with the teacher's top-K, "
        "the teacher's own answers where there is no reference), teacher (the teacher's "
        "answers only: pure context distillation), reference (reference answers one-hot).",
        choices=("auto", "teacher", "reference"),
    )
    reference_weight: float = option(
        0.8, "auto: the reference token's share of each target (the rest: the teacher's).",
        min=0.5,
    )  # fmt: skip
    top_k: int = option(16, "Teacher tokens per target position (top-K distillation).", min=1)
    context_window: int | None = option(
        None, "The teacher's context window in tokens (default: the model's config).", min=64
    )
    chunk_tokens: int | None = option(
        None,
        f"Longest chunk of a document the teacher sees (default: {DEFAULT_CHUNK_TOKENS}, or "
        "what the window leaves after the question and answer).",
        min=16,
    )
    max_answer_tokens: int = option(64, "Longest teacher (and receipt) answer.", min=1)
    batch_size: int = option(8, "Probes per step.", min=1)
    epochs: int | None = option(
        None,
        f"Passes over the training probes (default: {DEFAULT_EPOCHS}, fewer where the probes "
        f"are many: as many as fit in {STEP_BUDGET} steps, at least {MIN_EPOCHS}).",
        min=1,
    )
    max_steps: int | None = option(
        None, "Stop after this many steps (default: --epochs passes).", flags=("--steps",), min=1
    )
    on_policy_steps: int = option(
        0, "Then this many on-policy steps (train opsd's loop, the chunk as the teacher's hint).",
        min=0,
    )  # fmt: skip
    lora_rank: int = retune(TrainOptions, "lora_rank", 16)
    lr: float | None = option(
        None,
        f"Learning rate, falling linearly to 0 (default: {BASE_LR:g} at {DEFAULT_EPOCHS} or "
        f"more passes, {BASE_LR:g} x {DEFAULT_EPOCHS} / passes at fewer: {BASE_LR * 2:g} at 4).",
        flags=("--learning-rate",),
        gt=0,
    )
    save_every: int = retune(TrainOptions, "save_every", 0)


@dataclass
class InternalizePlan(Plan):
    documents: list[dict]  # name, characters, chunks, train and held-out probes
    train_probes: int
    held_out_probes: int
    probes_with_reference: int
    question_writer: str  # templates, or model: the child writes them (counted in the probes)
    teacher_model: str
    epochs: int
    lr: float
    context_window: int
    chunk_tokens: int
    chunking: str
    on_policy_steps: int


def default_epochs(steps_per_epoch: int) -> int:
    """``--epochs``' default for ``steps_per_epoch`` batches of probes (see STEP_BUDGET)."""
    return max(MIN_EPOCHS, min(DEFAULT_EPOCHS, STEP_BUDGET // steps_per_epoch))


def default_lr(epochs: int) -> float:
    """``--lr``'s default for ``epochs`` passes (see BASE_LR)."""
    return BASE_LR * max(1.0, DEFAULT_EPOCHS / epochs)


def model_config(model: str):
    """The model's transformers config, or None where it cannot be read (an offline hub id,
    an odd folder): read once, for the window and the question writer."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    except Exception:
        return None


def question_writer(opts: InternalizeOptions, config) -> str:
    """``--question-writer`` resolved: auto is model for a teacher of ``WRITER_MIN_PARAMS``
    or more (estimated from its ``config``: 12 x layers x hidden^2), else templates."""
    if opts.question_writer != "auto":
        return opts.question_writer
    try:
        size = 12 * config.num_hidden_layers * config.hidden_size**2
    except Exception:  # no config, an odd one: the safe choice
        return "templates"
    return "model" if size >= WRITER_MIN_PARAMS else "templates"


def read_questions(path: str) -> list[dict]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise RlcliError(f"--questions {path}: no such file")
    with file.open(encoding="utf-8", errors="replace") as f:
        return probes_mod.read_questions(f, f"--questions {path}")


def document_of(row: dict, names: list[str], path: str, number: int) -> int | None:
    """The 0-based document a ``--questions`` row names, or None (the best match decides)."""
    given = row["document"]
    if given is None:
        return None
    if isinstance(given, int):
        if 0 <= given < len(names):
            return given
    else:
        for i, name in enumerate(names):
            if given in (name, Path(name).name) or Path(given).expanduser() == Path(name):
                return i
    raise RlcliError(
        f"--questions {path}: row {number}: document {given!r} is not one of the documents"
    )


def window_of(config, given: int | None) -> int:
    """The context window: ``--context-window``, else the model ``config``'s, else 2048."""
    if given:
        return given
    found = getattr(config, "max_position_embeddings", None)
    return int(found) if found else 2048


def token_counter(tokenizer):
    if tokenizer is None:  # an offline hub id: about 1.3 tokens a word
        return lambda text: math.ceil(len(text.split()) * 1.3) + 1
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def build_probes(opts: InternalizeOptions, documents, chunked, count, writer) -> list[dict]:
    """Every probe with its document, chunk and split (seeded: a resume plans the same); no
    templated ones where the teacher writes them (``writer`` model)."""
    names = [d.name for d in documents]
    rows: list[dict] = []
    if opts.questions:
        for number, row in enumerate(read_questions(opts.questions), start=1):
            doc = document_of(row, names, opts.questions, number)
            about = row["question"] + " " + (row["answer"] or "")
            if doc is None:
                doc = max(
                    range(len(documents)),
                    key=lambda i: len(docs_mod.words(about) & docs_mod.words(documents[i].text)),
                )
            rows.append({**row, "document": doc, "chunk": docs_mod.best_chunk(chunked[doc], about)})
    for i, document in enumerate(documents):
        if writer == "templates":
            rows += probes_mod.templated(i, document.text, chunked[i], opts.n_questions)
    out = []
    for i in range(len(documents)):
        train, held = probes_mod.split(
            [r for r in rows if r["document"] == i], opts.test_size, opts.seed
        )
        out += train + held
    longest = max((count(r["question"]) for r in out), default=0)
    if longest > 4096:
        raise RlcliError(f"--questions {opts.questions}: a question of {longest} tokens")
    return out


class Internalize(Recipe):
    name = "internalize"
    options = InternalizeOptions
    help = (
        "Put documents into a LoRA (context distillation): the model answers from them with "
        "an empty context. With --hypernet, one document's LoRA from one forward pass of a "
        "doc-to-LoRA hypernetwork instead (no training)."
    )
    show = {"train_mean_nll": "loss", "learning_rate": "lr"}

    @property
    def command(self) -> str:
        return "rlcli internalize"

    def prepare(self, opts: InternalizeOptions, stdin=None, dry_run=False):
        """Documents, probes, chunks, split and steps; no server, no writes."""
        from rlcli.recipes.internalize_hypernet import check_mix

        check_mix(opts)  # --hypernet runs elsewhere; its flags alone are refused here
        if not opts.model:
            raise RlcliError("missing --model (or --hypernet tinker://ID/hypernet_weights/NAME)")
        check_model_arg(opts.model)
        check_renderer(opts.renderer)
        if opts.reference_weight > 1:
            raise RlcliError(f"--reference-weight {opts.reference_weight}: must be at most 1")
        if not opts.questions and not opts.n_questions:
            raise RlcliError("--n-questions 0: give probes with --questions FILE, or templates")
        teacher = opts.teacher or opts.model
        if teacher.startswith("tinker://"):
            raise RlcliError(f"--teacher {teacher}: a base model (a checkpoint is not a teacher)")
        if teacher != opts.model:
            try:
                check_model_arg(teacher)
            except RlcliError as e:
                raise RlcliError(str(e).replace("--model", "--teacher", 1)) from None
        run_dir = self.run_dir_of(opts)
        documents = docs_mod.read_documents(list(opts.documents or []), stdin)
        renderer, source, tokenizer = resolve(opts.model, opts.renderer)
        if teacher != opts.model:
            opsd.check_same_tokenizer(tokenizer, teacher)
        count = token_counter(tokenizer)
        config = model_config(teacher)
        window = window_of(config, opts.context_window)
        question_room = TEMPLATE_TOKENS + opts.max_answer_tokens
        probes_room = max(
            (
                count(p["question"])
                for p in (read_questions(opts.questions) if opts.questions else [])
            ),
            default=32,
        )
        room = window - question_room - max(probes_room, 32)
        if room < 16:
            raise RlcliError(
                f"--context-window {window}: too small for one chunk plus a question and its "
                f"answer ({question_room + max(probes_room, 32)} tokens before any document)"
            )
        chunk_tokens = opts.chunk_tokens or min(DEFAULT_CHUNK_TOKENS, room)
        if chunk_tokens > room:
            raise RlcliError(
                f"--chunk-tokens {chunk_tokens}: the window ({window}) leaves {room} for a chunk "
                "beside the question and answer"
            )
        chunked = [docs_mod.chunks(d.text, count, chunk_tokens) for d in documents]
        writer = question_writer(opts, config)
        probes = build_probes(opts, documents, chunked, count, writer)
        train = [p for p in probes if not p["held_out"]]
        # the teacher's questions, counted as asked (the child writes them; if it writes
        # fewer, the planned steps make more passes over them)
        to_write = opts.n_questions if writer == "model" else 0
        written_held = probes_mod.held_count(to_write, opts.test_size)
        written_train = to_write - written_held
        if not train and not written_train:
            raise RlcliError("no probe to train on: every probe is held out")
        for i, d in enumerate(documents):
            if not to_write and not any(p["document"] == i for p in probes):
                raise RlcliError(
                    f"DOCUMENT {d.name}: no probe about it (no sentence names anything for the "
                    "templates and no --questions row matches it); add --questions"
                )
        planned_train = len(train) + written_train * len(documents)
        steps_per_epoch = math.ceil(planned_train / opts.batch_size)
        epochs = opts.epochs or default_epochs(steps_per_epoch)
        plan = InternalizePlan(
            run_dir=str(run_dir),
            documents=[
                {
                    "name": d.name,
                    "characters": len(d.text),
                    "chunks": len(chunked[i]),
                    "train_probes": written_train + sum(1 for p in train if p["document"] == i),
                    "held_out_probes": written_held
                    + sum(1 for p in probes if p["document"] == i and p["held_out"]),
                }
                for i, d in enumerate(documents)
            ],
            train_probes=planned_train,
            held_out_probes=len(probes) - len(train) + written_held * len(documents),
            probes_with_reference=sum(1 for p in probes if p.get("answer")),
            question_writer=writer,
            teacher_model=teacher,
            epochs=epochs,
            lr=opts.lr or default_lr(epochs),
            context_window=window,
            chunk_tokens=chunk_tokens,
            chunking="whole sentences packed into chunks of at most chunk_tokens; each probe "
            "is answered beside its own chunk (templated: the chunk of its sentence; written "
            "by the teacher: the chunk it wrote it from; --questions: the chunk sharing the "
            "most words with it)",
            on_policy_steps=opts.on_policy_steps,
            steps=base.capped(steps_per_epoch * epochs, opts),
            renderer=renderer,
            renderer_source=source,
            resuming=base.resuming(run_dir),
        )
        kept = {
            "documents": [
                {"name": d.name, "text": d.text, "chunks": chunked[i]}
                for i, d in enumerate(documents)
            ],
            "probes": probes,
        }
        return plan, kept

    def check_server(self, server, opts: InternalizeOptions, plan, report) -> str:
        if plan.teacher_model != opts.model:
            opsd.check_teacher_model(server, plan.teacher_model, own_url=False)
        return server.backend or "unknown"

    def resolved_fields(self, opts: InternalizeOptions, plan, base_url: str) -> dict:
        documents = [
            str(Path(plan.run_dir) / STDIN_FILE) if d == "-" else d for d in opts.documents
        ]
        return {"documents": documents, "teacher": plan.teacher_model}

    def commit(self, opts: InternalizeOptions, plan, kept: dict) -> None:
        run_dir = Path(plan.run_dir)
        if "-" in opts.documents:
            stdin_doc = next(d for d in kept["documents"] if d["name"] == "stdin")
            path = run_dir / STDIN_FILE
            if not path.exists() or path.read_text() != stdin_doc["text"]:
                atomic.write_text(path, stdin_doc["text"])
        atomic.write_text(run_dir / DOCUMENTS_FILE, json.dumps(kept["documents"]) + "\n")
        base.keep_lines(run_dir / PROBES_FILE, kept["probes"])

    def describe(self, plan, served_by: str = "") -> str:
        n = len(plan.documents)
        written = " (questions written by the teacher)" if plan.question_writer == "model" else ""
        return (
            f"{n} document{'s' if n != 1 else ''}, {plan.train_probes} probes{written} "
            f"({plan.held_out_probes} held out), {plan.steps} steps; teacher {plan.teacher_model}"
            f" with the document in view"
        )

    # ---- in the recipe child ----------------------------------------------------------------

    def run_in_child(self, spec: dict) -> dict:
        return run(spec)


def resolve(model: str, requested: str | None):
    from rlcli.compat.renderer_choice import resolve_renderer

    return resolve_renderer(model, requested)

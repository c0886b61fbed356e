"""``rlcli internalize``: a document into a LoRA, so the model answers from it with an empty
context (per-document context distillation, Snell et al. 2022).

``prepare`` reads the documents and the probes (``--questions`` and templated ones,
``data/probes.py``), cuts the documents into chunks that fit the window, keeps a
``--test-size`` share of the probes out, and plans; no server, no writes. ``commit`` writes
the documents and probes into the run folder. The child (``run_in_child``) then asks the
teacher (the same model, or ``--teacher``, with the probe's chunk before the question) for
top-K targets (``client/context_distill.py``), trains a fresh LoRA toward them without the
document (``train_loop``: ``cross_entropy`` with ``[T, K]`` targets; a cookbook logger, so
progress, cancel and resume work as for every train command), optionally runs on-policy
steps with the chunk as the teacher's hint (opsd's recipe and teacher seam, ``on_policy``),
and writes the receipt: the held-out probes answered by the base model without the document,
with it (the ceiling), by the adapter without it, and by the control (the base model with an
unrelated document).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from rlcli.data import documents as docs_mod
from rlcli.data import probes as probes_mod
from rlcli.errors import RlcliError
from rlcli.files import atomic
from rlcli.flags import option, retune
from rlcli.recipes import base, opsd
from rlcli.recipes.base import Plan, Recipe
from rlcli.recipes.options import TrainOptions
from rlcli.recipes.preflight import check_model_arg, check_renderer

DOCUMENTS_FILE = "documents.json"  # the documents and their chunks, as the run reads them
PROBES_FILE = "probes.jsonl"  # every probe, its document, chunk and split
TARGETS_FILE = "targets.jsonl"  # the teacher's targets (asked once; a resume reads them)
RECEIPT_FILE = "receipt.json"
ON_POLICY_DIR = "on_policy"  # the opsd phase's own run folder, inside this one
STDIN_FILE = "stdin.txt"  # DOCUMENT - kept for resume
DEFAULT_CHUNK_TOKENS = 1024  # the default chunk, when the window allows it
TEMPLATE_TOKENS = 16  # what the teacher's prompt adds around chunk and question
# The control: the base model with this in its context instead of the document (one document).
UNRELATED = (
    "The museum opens at nine and closes at five. Visitors may bring cameras but not food. "
    "Guided tours start every hour from the main hall. The gift shop sells maps and postcards."
)


@dataclass(kw_only=True)
class InternalizeOptions(TrainOptions):
    documents: list[str] = option(
        help="Documents: files, folders (every file in them), or - for stdin.", argument=True
    )
    questions: str | None = option(
        None,
        'Probes JSONL: {"question": ..., "answer": ...} (answer optional; "document": a path '
        'or index; "held_out": true keeps a row for the receipt).',
    )
    n_questions: int = option(60, "Templated probes per document (0: only --questions).", min=0)
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
        0.5, "auto: the reference token's share of each target (the rest: the teacher's).",
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
    epochs: int = option(4, "Passes over the training probes.", min=1)
    max_steps: int | None = option(
        None, "Stop after this many steps (default: --epochs passes).", flags=("--steps",), min=1
    )
    on_policy_steps: int = option(
        0, "Then this many on-policy steps (train opsd's loop, the chunk as the teacher's hint).",
        min=0,
    )  # fmt: skip
    lora_rank: int = retune(TrainOptions, "lora_rank", 16)
    lr: float = retune(TrainOptions, "lr", 5e-4)
    save_every: int = retune(TrainOptions, "save_every", 0)


@dataclass
class InternalizePlan(Plan):
    documents: list[dict]  # name, characters, chunks, train and held-out probes
    train_probes: int
    held_out_probes: int
    probes_with_reference: int
    teacher_model: str
    context_window: int
    chunk_tokens: int
    chunking: str
    on_policy_steps: int


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


def window_of(model: str, given: int | None) -> int:
    """The context window: ``--context-window``, else the model config's, else 2048."""
    if given:
        return given
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
        found = getattr(config, "max_position_embeddings", None)
        return int(found) if found else 2048
    except Exception:
        return 2048


def token_counter(tokenizer):
    if tokenizer is None:  # an offline hub id: about 1.3 tokens a word
        return lambda text: math.ceil(len(text.split()) * 1.3) + 1
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def build_probes(opts: InternalizeOptions, documents, chunked, count) -> list[dict]:
    """Every probe with its document, chunk and split (seeded: a resume plans the same)."""
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
        for probe in probes_mod.template_probes(document.text, opts.n_questions):
            sentence = probe["answer"] if probe["answer"] in document.text else probe["question"]
            chunk = next(
                (j for j, piece in enumerate(chunked[i]) if sentence in piece),
                docs_mod.best_chunk(chunked[i], sentence),
            )
            rows.append({**probe, "document": i, "chunk": chunk})
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
        "an empty context."
    )
    show = {"train_mean_nll": "loss", "learning_rate": "lr"}

    @property
    def command(self) -> str:
        return "rlcli internalize"

    def prepare(self, opts: InternalizeOptions, stdin=None, dry_run=False):
        """Documents, probes, chunks, split and steps; no server, no writes."""
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
        window = window_of(teacher, opts.context_window)
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
        probes = build_probes(opts, documents, chunked, count)
        train = [p for p in probes if not p["held_out"]]
        if not train:
            raise RlcliError("no probe to train on: every probe is held out")
        for i, d in enumerate(documents):
            if not any(p["document"] == i for p in probes):
                raise RlcliError(
                    f"DOCUMENT {d.name}: no probe about it (no sentence names anything for the "
                    "templates and no --questions row matches it); add --questions"
                )
        steps_per_epoch = math.ceil(len(train) / opts.batch_size)
        plan = InternalizePlan(
            run_dir=str(run_dir),
            documents=[
                {
                    "name": d.name,
                    "characters": len(d.text),
                    "chunks": len(chunked[i]),
                    "train_probes": sum(1 for p in train if p["document"] == i),
                    "held_out_probes": sum(
                        1 for p in probes if p["document"] == i and p["held_out"]
                    ),
                }
                for i, d in enumerate(documents)
            ],
            train_probes=len(train),
            held_out_probes=len(probes) - len(train),
            probes_with_reference=sum(1 for p in probes if p.get("answer")),
            teacher_model=teacher,
            context_window=window,
            chunk_tokens=chunk_tokens,
            chunking="whole sentences packed into chunks of at most chunk_tokens; each probe "
            "is answered beside its own chunk (templated: the chunk of its sentence; "
            "--questions: the chunk sharing the most words with it)",
            on_policy_steps=opts.on_policy_steps,
            steps=base.capped(steps_per_epoch * opts.epochs, opts),
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
        return (
            f"{n} document{'s' if n != 1 else ''}, {plan.train_probes} probes "
            f"({plan.held_out_probes} held out), {plan.steps} steps; teacher {plan.teacher_model}"
            f" with the document in view"
        )

    # ---- in the recipe child ----------------------------------------------------------------

    def run_in_child(self, spec: dict) -> dict:
        return run(spec)


def resolve(model: str, requested: str | None):
    from rlcli.compat.renderer_choice import resolve_renderer

    return resolve_renderer(model, requested)


# ---- the child's work: targets, training, on-policy steps, receipt ------------------------


def run(spec: dict) -> dict:
    """The child's phases, each its own event loop (the opsd recipe runs its own)."""
    import tinker

    opts, plan = spec["options"], spec["plan"]
    run_dir = Path(plan["run_dir"])
    documents = json.loads((run_dir / DOCUMENTS_FILE).read_text())
    probes = [json.loads(line) for line in (run_dir / PROBES_FILE).read_text().splitlines()]
    train = [p for p in probes if not p["held_out"]]
    render = renderer_of(spec)
    service = tinker.ServiceClient(base_url=opts["base_url"])
    rows = asyncio.run(targets(spec, service, render, documents, train))
    paths = asyncio.run(train_loop(spec, service, rows))
    if opts["on_policy_steps"]:
        paths = on_policy(spec, documents, train, render, paths)
    receipt = asyncio.run(score(spec, service, render, documents, probes, paths["sampler_path"]))
    atomic.write_text(run_dir / RECEIPT_FILE, json.dumps(receipt, indent=2) + "\n")
    return {
        "run_dir": str(run_dir),
        "state_path": paths["state_path"],
        "sampler_path": paths["sampler_path"],
        "receipt": receipt,
    }


def renderer_of(spec: dict):
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from rlcli.client.context_distill import Renderer

    tokenizer = get_tokenizer(spec["options"]["model"])
    return Renderer(renderers.get_renderer(spec["plan"]["renderer"], tokenizer))


def status(spec: dict, phase: str, **fields) -> None:
    from rlcli.runs.folder import append_status

    append_status(Path(spec["plan"]["run_dir"]), phase, **fields)


async def gathered(coroutines, spec: dict, phase: str, limit: int = 16) -> list:
    """Run ``coroutines`` ``limit`` at a time, saying ``phase (done/total)`` as they finish."""
    semaphore = asyncio.Semaphore(limit)
    done = [0]

    async def one(coroutine):
        async with semaphore:
            result = await coroutine
        done[0] += 1
        status(spec, f"{phase} ({done[0]}/{len(coroutines)})")
        return result

    status(spec, f"{phase} (0/{len(coroutines)})")
    return await asyncio.gather(*(one(c) for c in coroutines))


async def targets(spec, service, render, documents, train) -> list[dict]:
    """The teacher's targets for every training probe, asked once and kept in the run folder."""
    from rlcli.client.context_distill import teacher_row

    opts, plan = spec["options"], spec["plan"]
    path = Path(plan["run_dir"]) / TARGETS_FILE
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(rows) == len(train):
            return rows
    teacher = await service.create_sampling_client_async(base_model=plan["teacher_model"])
    rows = await gathered(
        [
            teacher_row(
                teacher,
                render,
                p,
                documents[p["document"]]["chunks"][p["chunk"]],
                opts["top_k"],
                opts["targets"],
                opts["reference_weight"],
                opts["max_answer_tokens"],
            )  # fmt: skip
            for p in train
        ],
        spec,
        "the teacher answers the probes with the document in view",
    )
    atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def batches(rows: list, batch_size: int, seed: int, step: int) -> list:
    """Step ``step``'s rows: each epoch is the rows shuffled by ``seed`` and the epoch, cut into
    batches (the last one partial), so a resumed run sees what it would have."""
    per_epoch = math.ceil(len(rows) / batch_size)
    epoch, index = divmod(step, per_epoch)
    order = list(range(len(rows)))
    random.Random(seed * 1000 + epoch).shuffle(order)
    return [rows[i] for i in order[index * batch_size : (index + 1) * batch_size]]


async def train_loop(spec: dict, service, rows: list[dict]) -> dict:
    """Train a fresh LoRA toward ``rows`` (``cross_entropy`` on ``[T, K]`` targets), logging
    each step through the cookbook's logger (progress, ``runs cancel``), saving every
    ``--save-every`` steps and at the end; resumes from the run's last checkpoint. Returns the
    final checkpoint's paths."""
    import tinker
    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.utils import ml_log

    from rlcli.client.context_distill import datum
    from rlcli.compat.run_hooks import RunCancelled

    opts, plan = spec["options"], spec["plan"]
    log_path, steps = plan["run_dir"], plan["steps"]
    last = checkpoint_utils.get_last_checkpoint(log_path)
    if last is not None and last.final:
        return {"state_path": last.state_path, "sampler_path": last.get("sampler_path")}
    if last is not None:
        trainer = await service.create_training_client_from_state_with_optimizer_async(
            last.state_path
        )
        start = int(last.batch or 0)
    else:
        trainer = await service.create_lora_training_client_async(
            base_model=opts["model"], rank=opts["lora_rank"], seed=opts["seed"]
        )
        start = 0
    logger = ml_log.setup_logging(
        log_dir=log_path,
        wandb_project=opts["wandb_project"],
        wandb_name=opts["wandb_name"],
        do_configure_logging_module=False,
    )
    status(spec, "training the adapter without the document")
    step = start
    try:
        for step in range(start, steps):
            lr = opts["lr"] * (1 - step / steps)
            batch = batches(rows, opts["batch_size"], opts["seed"], step)
            data = [datum(r) for r in batch]
            backward = await trainer.forward_backward_async(data, "cross_entropy")
            update = await trainer.optim_step_async(tinker.AdamParams(learning_rate=lr))
            result = await backward.result_async()
            await update.result_async()
            weight = sum(sum(map(sum, r["target_weights"])) for r in batch) or 1.0
            logger.log_metrics(
                {
                    "train_mean_nll": result.metrics["loss:sum"] / weight,
                    "learning_rate": lr,
                    "num_tokens": sum(d.model_input.length for d in data),
                    "progress": (step + 1) / steps,
                },
                step=step,
            )
            every = opts["save_every"]
            if every and (step + 1) % every == 0 and step + 1 < steps:
                status(spec, "saving checkpoint", step=step)
                await checkpoint_utils.save_checkpoint_async(
                    trainer, f"{step + 1:06d}", log_path, {"batch": step + 1}, kind="both"
                )
    except RunCancelled as cancelled:
        status(spec, "cancelling: saving a checkpoint", step=cancelled.step)
        cancelled.paths = await checkpoint_utils.save_checkpoint_async(
            trainer, f"{cancelled.step + 1:06d}", log_path,
            {"batch": cancelled.step + 1, "cancelled": True}, kind="both",
        )  # fmt: skip
        raise
    finally:
        logger.close()
    status(spec, "saving final checkpoint")
    return await checkpoint_utils.save_checkpoint_async(
        trainer, "final", log_path, {"batch": steps, "final": True}, kind="both"
    )


def on_policy(spec: dict, documents, train, render, paths: dict) -> dict:
    """``--on-policy-steps``: ``train opsd``'s recipe from the adapter just trained, in its own
    folder (``on_policy/``), each probe's chunk the teacher's hint (opsd's teacher seam with one
    hint per prompt). Returns its final checkpoint's paths."""
    from rlcli.compat import distill
    from rlcli.recipes.rl import seed_sampling

    opts, plan = spec["options"], spec["plan"]
    folder = Path(plan["run_dir"]) / ON_POLICY_DIR
    folder.mkdir(exist_ok=True)
    prompts_path = folder / opsd.DATASET_FILE
    base.keep_lines(prompts_path, [{"prompt": p["question"]} for p in train])
    hinted = {
        tuple(render.prompt(p["question"])): render.prompt(
            p["question"], documents[p["document"]]["chunks"][p["chunk"]]
        )
        for p in train
    }
    options = {
        "model": opts["model"], "base_url": opts["base_url"], "lr": opts["lr"] * 0.2,
        "lora_rank": opts["lora_rank"], "save_every": opts["save_every"],
        "wandb_project": opts["wandb_project"], "wandb_name": opts["wandb_name"],
        "batch_size": opts["batch_size"], "group_size": 4, "seed": opts["seed"],
        "max_tokens": opts["max_answer_tokens"], "temperature": 1.0, "kl_coef": 1.0,
        "kl_discount": 0.0, "loss": "importance_sampling", "loss_config": None,
        "init_checkpoint": paths["state_path"], "teacher_base_url": opts["base_url"],
    }  # fmt: skip
    opsd_plan = {
        "run_dir": str(folder), "dataset_path": str(prompts_path), "renderer": plan["renderer"],
        "teacher_model": plan["teacher_model"], "teacher_checkpoint": None,
        "steps": opts["on_policy_steps"],
    }  # fmt: skip
    opsd_spec = {"recipe": "opsd", "options": options, "plan": opsd_plan}
    recipe = opsd.Opsd()
    config = recipe.cookbook_config(opsd_spec)
    teachers: dict[int, distill.Teacher] = {}

    def teacher_for(client):
        return teachers.setdefault(id(client), distill.Teacher(client, hinted))

    distill.score_teachers_with(teacher_for)
    seed_sampling(opts["seed"])
    status(spec, f"on-policy steps with the document as the teacher's hint ({folder})")
    from tinker_cookbook.distillation import train_on_policy

    asyncio.run(train_on_policy.main(config))
    last = base.summary_of(str(folder))
    return {"state_path": last["state_path"], "sampler_path": last["sampler_path"]}


async def score(spec, service, render, documents, probes, sampler_path: str) -> dict:
    """The receipt: each held-out probe answered, with an empty context, by the base model and
    the adapter; with its chunk by the base model (the ceiling); with an unrelated text by the
    base model (the control). Right by the reference, else by agreeing with the ceiling."""
    from rlcli.client.context_distill import answer, correct

    opts = spec["options"]
    held = [p for p in probes if p["held_out"]]
    base_client = await service.create_sampling_client_async(base_model=opts["model"])
    adapter = await service.create_sampling_client_async(model_path=sampler_path)
    n = opts["max_answer_tokens"]

    def unrelated(p) -> str:
        if len(documents) == 1:
            return UNRELATED
        other = documents[(p["document"] + 1) % len(documents)]
        return other["chunks"][0]

    def chunk(p) -> str:
        return documents[p["document"]]["chunks"][p["chunk"]]

    jobs = []
    for p in held:
        q = p["question"]
        jobs += [
            answer(base_client, render, q, None, n),
            answer(base_client, render, q, chunk(p), n),
            answer(adapter, render, q, None, n),
            answer(base_client, render, q, unrelated(p), n),
        ]
    said = await gathered(jobs, spec, "scoring the held-out probes")
    rows = []
    for i, p in enumerate(held):
        base_a, ceiling, adapted, control = said[4 * i : 4 * i + 4]
        rows.append(
            {
                "document": p["document"],
                "question": p["question"],
                "reference": p.get("check") or p.get("answer"),
                "answers": {
                    "base": base_a,
                    "in_context": ceiling,
                    "internalized": adapted,
                    "control": control,
                },  # fmt: skip
                "correct": {
                    name: correct(text, p, ceiling)
                    for name, text in (
                        ("base", base_a),
                        ("in_context", ceiling),
                        ("internalized", adapted),
                        ("control", control),
                    )
                },  # fmt: skip
            }
        )
    per_document = []
    for i, d in enumerate(documents):
        mine = [r for r in rows if r["document"] == i]
        per_document.append({"document": d["name"], "held_out": len(mine), **scores(mine)})
    return {
        "sampler_path": sampler_path,
        "held_out": len(rows),
        "scores": scores(rows),
        "documents": per_document,
        "control": "the base model with an unrelated text in its context"
        if len(documents) == 1
        else "the base model with another of the documents in its context",
        "probes": rows,
    }


def scores(rows: list[dict]) -> dict:
    names = ("base", "in_context", "internalized", "control")
    if not rows:
        return {name: None for name in names}
    return {name: sum(r["correct"][name] for r in rows) / len(rows) for name in names}

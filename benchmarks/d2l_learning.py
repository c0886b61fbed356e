"""Doc-to-LoRA: does a hypernetwork trained on synthetic fact documents answer held-out
documents' questions once each document is internalized, and how long does one
internalization take?

Part 1 (learning, the tiny model by default): a server of the model; a hypernetwork trained
through the server's routes (what ``rlcli train d2l`` calls) on ``--steps`` batches of
one-fact documents (``data/d2l_examples.synthetic_facts``: made-up names, answers from closed
sets of 8, so chance is 1/8); then, for held-out documents of another seed, greedy answers
through the tinker SDK from: the base model with an empty context, the base model with the
document in the prompt, the document's own generated adapter, and a control (the adapter of
another held-out document). Exact match: the answer starts the reply (case and punctuation
aside). Also the held-out answer loss with the right and with a shuffled document.

Part 2 (``--timing-model``, e.g. SmolLM2-135M-Instruct): a fresh hypernetwork of the default
shape on that model's server, and the time of one internalization of a ~1,000-token document
(the engine's own seconds: chunks, the base model's forward, the hypernetwork, and the
round trip of the HTTP call that also writes the sampler checkpoint).

    .venv/bin/python benchmarks/d2l_learning.py [--steps 600] [--timing-model DIR]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _receipt  # noqa: E402


def normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", " ", text.lower()).strip()


def matches(reply: str, answer: str) -> bool:
    words = normalize(reply).split()
    return bool(words) and words[0] == normalize(answer)


def mentions(reply: str, answer: str) -> bool:
    """Looser than ``matches``: the answer anywhere in the reply ("Kalo lives in Paris.")."""
    return normalize(answer) in normalize(reply).split()


def prompt_ids(tok, question: str, document: str | None = None) -> list[int]:
    content = f"{document}\n\n{question}" if document else question
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def greedy(service, tok, ids: list[int], *, model: str | None = None, path: str | None = None):
    import tinker

    if path:
        client = service.create_sampling_client(model_path=path).result()
    else:
        client = service.create_sampling_client(base_model=model).result()
    params = tinker.SamplingParams(max_tokens=8, temperature=0.0)
    out = client.sample(tinker.ModelInput.from_ints(ids), 1, params).result()
    return tok.decode(out.sequences[0].tokens, skip_special_tokens=True)


def learning(args, model: str, tmp: str) -> dict:
    import tinker
    from transformers import AutoTokenizer

    from rlcli.client.d2l import Hypernets
    from rlcli.data.d2l_examples import synthetic_facts

    tok = AutoTokenizer.from_pretrained(model)
    train = synthetic_facts(args.steps * args.batch, seed=0)
    seen = {r["document"] for r in train}  # held out: documents training never saw
    held = [r for r in synthetic_facts(4 * args.held_out, seed=12345) if r["document"] not in seen]
    held = held[: args.held_out]
    with _receipt.local_server(model, tmp, wait=900, dtype=args.dtype) as record:
        url = record.base_url
        hn = Hypernets(url)
        made = hn.create(seed=0, rank=args.rank, latent=args.latent, lora_layers=args.lora_layers)
        hid = made["hypernet_id"]
        shuffled = [dict(r, document=held[(i + 1) % len(held)]["document"]) for i, r in
                    enumerate(held)]  # fmt: skip
        before = {
            "right_document": hn.step(hid, held, args.lr, train=False)["loss"],
            "other_document": hn.step(hid, shuffled, args.lr, train=False)["loss"],
        }
        losses, started = [], time.perf_counter()
        for s in range(args.steps):
            out = hn.step(hid, train[s * args.batch : (s + 1) * args.batch], args.lr)
            losses.append(out["loss"])
            if s % 50 == 0:
                print(f"step {s} loss {out['loss']:.3f}", flush=True)
        train_s = time.perf_counter() - started
        after = {
            "right_document": hn.step(hid, held, args.lr, train=False)["loss"],
            "other_document": hn.step(hid, shuffled, args.lr, train=False)["loss"],
        }
        path = hn.save(hid, "final")["path"]
        service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        adapters, seconds, round_trips = [], [], []
        for row in held:
            t0 = time.perf_counter()
            out = hn.internalize(path, row["document"])
            round_trips.append(time.perf_counter() - t0)
            seconds.append(out["seconds"])
            adapters.append(out["path"])
        rows = []
        for i, row in enumerate(held):
            ids = prompt_ids(tok, row["question"])
            replies = {
                "base_empty_context": greedy(service, tok, ids, model=model),
                "base_in_context": greedy(
                    service, tok, prompt_ids(tok, row["question"], row["document"]), model=model
                ),
                "d2l": greedy(service, tok, ids, path=adapters[i]),
                "control_other_document": greedy(
                    service, tok, ids, path=adapters[(i + 1) % len(held)]
                ),
            }
            correct = {k: matches(v, row["answer"]) for k, v in replies.items()}
            mentioned = {k: mentions(v, row["answer"]) for k, v in replies.items()}
            rows.append({**row, "replies": replies, "correct": correct, "mentioned": mentioned})
    arms = rows[0]["correct"].keys()
    accuracy = {k: sum(r["correct"][k] for r in rows) / len(rows) for k in arms}
    mentioned = {k: sum(r["mentioned"][k] for r in rows) / len(rows) for k in arms}
    return {
        "model": model,
        "hypernet": {
            k: made[k] for k in ("params", "rank", "latent", "n_layers", "first_layer", "d_in")
        },
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "train_seconds": train_s,
        "losses_every_10": losses[::10],
        "held_out_loss_before": before,
        "held_out_loss_after": after,
        "exact_match": accuracy,
        "answer_in_reply": mentioned,
        "chance": 1 / 8,
        "held_out_documents": len(held),
        "internalize_engine_s": _receipt.summary(seconds),
        "internalize_round_trip_s": _receipt.summary(round_trips),
        "rows": rows[:16],
    }


def timing(args, tmp: str) -> dict:
    from transformers import AutoTokenizer

    from rlcli.client.d2l import Hypernets
    from rlcli.data.d2l_examples import synthetic_facts

    tok = AutoTokenizer.from_pretrained(args.timing_model)
    doc = synthetic_facts(1, seed=7, filler=120)[0]["document"]
    ids = tok(doc, add_special_tokens=False)["input_ids"][: args.doc_tokens]
    doc = tok.decode(ids)
    with _receipt.local_server(
        args.timing_model, Path(tmp) / "t", wait=900, dtype="float32"
    ) as record:
        hn = Hypernets(record.base_url)
        made = hn.create(seed=0)
        path = hn.save(made["hypernet_id"], "fresh")["path"]
        hn.internalize(path, doc)  # warm: the hypernetwork loaded from its checkpoint
        engine, trips = [], []
        for _ in range(args.timing_rounds):
            t0 = time.perf_counter()
            out = hn.internalize(path, doc)
            trips.append(time.perf_counter() - t0)
            engine.append(out["seconds"])
        status = _receipt.server_status(record.base_url) or {}
    return {
        "model": args.timing_model,
        "dtype": (status.get("engine") or {}).get("dtype"),
        "hypernet_params": made["params"],
        "document_tokens": out["tokens"],
        "chunks": out["chunks"],
        "adapter_rank": out["rank"],
        "internalize_engine_s": _receipt.summary(engine),
        "internalize_round_trip_s": _receipt.summary(trips),
        "target_s": 1.0,
        "meets_target": statistics.median(engine) < 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the tiny model)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--latent", type=int, default=64)
    parser.add_argument("--lora-layers", type=int, default=0, help="adapt the last N (0: all)")
    parser.add_argument("--dtype", default="float32", help="the learning server's dtype")
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--timing-model", default=None, help="e.g. a SmolLM2 folder")
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--timing-rounds", type=int, default=5)
    parser.add_argument("--name", default="d2l_learning")
    args = parser.parse_args()
    _receipt.exit_on_sigterm()

    from rlcli.models.tiny import build_tiny_model

    payload: dict = {"load_average": Path("/proc/loadavg").read_text().split()[:3]}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_tiny_model(Path(tmp) / "tiny"))
        payload["learning"] = learning(args, model, tmp)
        print(payload["learning"]["exact_match"], flush=True)
        if args.timing_model:
            payload["timing"] = timing(args, tmp)
    learned = payload["learning"]["exact_match"]
    payload["meets_target"] = (
        learned["d2l"] > learned["base_empty_context"] + 0.1
        and learned["d2l"] > learned["control_other_document"] + 0.1
    )
    print(_receipt.write(args.name, payload))


if __name__ == "__main__":
    main()

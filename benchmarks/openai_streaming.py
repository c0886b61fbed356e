"""Streaming through the OpenAI-compatible endpoint vs the Tinker sample path vs
``transformers`` ``generate``, on SmolLM2-135M-Instruct, with 1 and 8 concurrent clients.

Each client asks one chat answer (the same long-answer prompt, its own seed, ``--tokens`` at
most) at the same moment:
- ``openai_stream``: the official ``openai`` client, ``/v1/chat/completions`` with
  ``stream: true``; time to first token = first content chunk; tokens from ``usage``.
- ``tinker_sample``: the tinker SDK's ``sample`` on the same rendered prompt tokens (no
  streaming: its first token arrives with the whole answer, so its "TTFT" is the answer's
  latency).
- ``generate``: ``transformers`` ``generate`` in-process, one batch of all clients' prompts in
  the server's dtype; TTFT = a 1-token ``generate`` of that batch.
Tokens/s is the clients' tokens over the wall time from the first request to the last answer.
Targets (issue 22): TTFT under 0.5 s at 1 client on 2 CPU cores; openai_stream tokens/s within
10% of tinker_sample's.

    flock /tmp/rlcli-heavy.lock python benchmarks/openai_streaming.py [--rounds 2] [--tokens 64]
    python benchmarks/openai_streaming.py --model ./tiny --tokens 8 --name openai_streaming_tiny
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_folder  # noqa: E402

PROMPT = "Write a long, detailed story about a dragon who learns to cook. Use at least 500 words."
MESSAGES = [{"role": "user", "content": PROMPT}]


def _concurrently(clients: int, one) -> tuple[float, list[dict]]:
    """Run ``one(i)`` in ``clients`` threads started together; (wall seconds, their results)."""
    results: list[dict | None] = [None] * clients
    start = threading.Barrier(clients + 1)

    def run(i: int) -> None:
        start.wait()
        results[i] = one(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, results


def openai_stream(client, model: str, tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    first, usage = None, None
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=tokens, seed=seed, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if first is None and any(c.delta.content for c in chunk.choices):
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    return {"ttft_s": first, "tokens": usage.completion_tokens, "s": time.perf_counter() - t0}


def tinker_sample(sampler, prompt, tokens: int, seed: int) -> dict:
    from tinker import types

    t0 = time.perf_counter()
    params = types.SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed)
    out = sampler.sample(prompt, 1, params).result()
    took = time.perf_counter() - t0
    return {"ttft_s": took, "tokens": len(out.sequences[0].tokens), "s": took}


def measure(model_dir: str, args) -> dict:
    import openai
    import tinker
    import torch
    from tinker import types
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcli.server.engine.hardware import pick_dtype

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    dtype = pick_dtype("auto", torch.device("cpu"))
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, _receipt.local_server(model_dir, tmp) as record:
        client = openai.OpenAI(base_url=f"{record.base_url}/v1", api_key="tml-dummy")
        service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
        sampler = service.create_sampling_client(base_model=model_dir).result()
        prompt = types.ModelInput.from_ints(list(ids))

        def generate(clients: int, n: int) -> float:
            x = torch.tensor([list(ids)] * clients)
            t0 = time.perf_counter()
            with torch.inference_mode():
                local.generate(
                    x, attention_mask=torch.ones_like(x), do_sample=True, top_k=0,
                    max_new_tokens=n, min_new_tokens=n, pad_token_id=tokenizer.pad_token_id,
                )  # fmt: skip
            return time.perf_counter() - t0

        paths = {
            "openai_stream": lambda i, r: openai_stream(
                client, model_dir, args.tokens, 100 * r + i
            ),
            "tinker_sample": lambda i, r: tinker_sample(sampler, prompt, args.tokens, 100 * r + i),
        }
        openai_stream(client, model_dir, 4, 0)  # warm up (the endpoint loads its tokenizer)
        tinker_sample(sampler, prompt, 4, 0)
        generate(1, 2)
        for clients in args.clients:
            for r in range(args.rounds):
                for name, one in paths.items():
                    wall, results = _concurrently(clients, lambda i, one=one, r=r: one(i, r))
                    tokens = sum(x["tokens"] for x in results)
                    rows.append({
                        "path": name, "clients": clients, "round": r, "wall_s": wall,
                        "tokens": tokens, "tokens_per_s": tokens / wall,
                        "ttft_s": sorted(x["ttft_s"] for x in results),
                    })  # fmt: skip
                ttft = generate(clients, 1)
                wall = generate(clients, args.tokens)
                rows.append({
                    "path": "generate", "clients": clients, "round": r, "wall_s": wall,
                    "tokens": clients * args.tokens,
                    "tokens_per_s": clients * args.tokens / wall, "ttft_s": [ttft] * clients,
                })  # fmt: skip
    return {"prompt_tokens": len(ids), "server_dtype": str(dtype).removeprefix("torch."),
            "rows": rows, "summary": summarise(rows, args.clients)}  # fmt: skip


def summarise(rows: list[dict], clients: list[int]) -> dict:
    out = {}
    for n in clients:
        by = {}
        for path in ("openai_stream", "tinker_sample", "generate"):
            mine = [r for r in rows if r["path"] == path and r["clients"] == n]
            by[path] = {
                "tokens_per_s": _receipt.summary([r["tokens_per_s"] for r in mine])["median"],
                "ttft_median_s": _receipt.summary(
                    [r["ttft_s"][len(r["ttft_s"]) // 2] for r in mine]
                )["median"],  # fmt: skip
            }
        by["openai_vs_tinker_tokens_per_s"] = (
            by["openai_stream"]["tokens_per_s"] / by["tinker_sample"]["tokens_per_s"]
        )
        out[f"{n}_clients"] = by
    one = out.get("1_clients")
    if one:
        out["target_ttft_under_0_5_s_at_1_client"] = one["openai_stream"]["ttft_median_s"] < 0.5
        out["target_within_10_percent_of_tinker"] = all(
            v["openai_vs_tinker_tokens_per_s"] >= 0.9
            for k, v in out.items()
            if k.endswith("_clients")
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="openai_streaming_smollm2")
    args = parser.parse_args()
    cache = Path(tempfile.gettempdir()) / "rlcli-bench-smollm2"
    model_dir = args.model or str(smollm2_folder(cache))
    result = measure(model_dir, args)
    path = _receipt.write(args.name, {"model": model_dir, "max_tokens": args.tokens, **result})
    print(path)
    print(result["summary"])


if __name__ == "__main__":
    main()

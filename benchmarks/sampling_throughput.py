"""Sampling throughput: the server (through the tinker SDK) vs ``transformers`` ``generate``
in-process, same model, same prompts, same length, batch 1 and batch 8.

Server: ``num_samples=B`` on one request (rows decode as one KV-cached batch). Baseline:
``model.generate`` on the same prompt repeated B times, ``do_sample=True``, ``top_k=0``,
``min_new_tokens=max_new_tokens`` so both produce exactly the same number of tokens.
Target (issue 3): the server at >= 0.9x in-process tokens/s at batch 8.

    python benchmarks/sampling_throughput.py [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="sampling_throughput")
    args = parser.parse_args()

    import tinker
    import torch
    from tinker import types
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcli.models.tiny import build_tiny_model

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(
            build_tiny_model(Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers)
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompt_ids = tokenizer.encode("What is 12 + 30? Think step by step.")
        with _receipt.local_server(model_dir, tmp, wait=300) as record:
            service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
            sampler = service.create_sampling_client(base_model=model_dir).result()
            model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
            prompt = types.ModelInput.from_ints(prompt_ids)
            params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0)

            def server(batch) -> int:
                out = sampler.sample(prompt, batch, params).result()
                return sum(len(s.tokens) for s in out.sequences)  # a row may end at EOS

            def local(batch) -> int:
                ids = torch.tensor([prompt_ids] * batch)
                with torch.inference_mode():
                    out = model.generate(
                        ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                        top_p=1.0, temperature=1.0, max_new_tokens=args.tokens,
                        min_new_tokens=args.tokens, pad_token_id=tokenizer.pad_token_id,
                    )  # fmt: skip
                assert out.shape[1] == len(prompt_ids) + args.tokens
                return batch * args.tokens

            for batch in (1, 8):
                server(batch), local(batch)  # warm up
                server_s, local_s = [], []  # tokens/s of each run
                for _ in range(args.rounds):
                    for fn, sink in ((server, server_s), (local, local_s)):
                        t0 = time.perf_counter()
                        tokens = fn(batch)
                        sink.append(tokens / (time.perf_counter() - t0))
                s, b = _receipt.summary(server_s), _receipt.summary(local_s)
                results[f"batch_{batch}"] = {
                    "server_tokens_per_s": s["median"],
                    "inprocess_tokens_per_s": b["median"],
                    "server_tokens_per_s_stats": s,
                    "inprocess_tokens_per_s_stats": b,
                    "ratio": s["median"] / b["median"],
                    "raw_tokens_per_s": {"server": server_s, "inprocess": local_s},
                }

    ratio8 = results["batch_8"]["ratio"]
    path = _receipt.write(
        args.name,
        {
            "what": "tokens/s sampling: server via the tinker SDK vs transformers generate",
            "model": f"rlcli tiny Qwen3, hidden {args.hidden}, {args.layers} layers",
            "new_tokens": args.tokens,
            "prompt_tokens": len(prompt_ids),
            **results,
            "target_ratio_batch_8": 0.9,
            "meets_target": ratio8 >= 0.9,
        },
    )
    for key, r in results.items():
        print(
            f"{key}: server {r['server_tokens_per_s']:.0f} tok/s, generate "
            f"{r['inprocess_tokens_per_s']:.0f} tok/s, ratio {r['ratio']:.2f}"
        )
    print(f"-> {path}")


if __name__ == "__main__":
    main()

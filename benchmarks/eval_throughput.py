"""`eval rl` throughput: the library (``rlcli.client.evaluate.evaluate``: every task's request
in flight at once through the SDK, the server batching across tasks, each answer graded by its env)
against the same prompts through ``transformers`` ``model.generate`` in-process (batched,
left-padded, greedy, the same max new tokens, stopping at the same end-of-turn token).

A third column runs the server's own engine (``rlcli.server.engine.core.Engine.sample``) in-process
on the same prompts in batches of 64: the server's decoding without its request path, which
separates the cost of batching and HTTP from the cost of the decode loop itself.

Both are greedy, so they should write the same answers; the receipt says how many tasks agree
(batched float32 kernels may still flip a near-tie).
Tokens/s counts the tokens each side generated (up to and including the end-of-turn token);
tasks/s the tasks per second of generation (the in-process side does no grading, the server
side grades every answer). Target (issue 12): the server at >= 1x in-process tasks/s.

    python benchmarks/eval_throughput.py [--tasks 64] [--tokens 48] [--rounds 3]

GSM8K is measured when ``$RLCLI_GSM8K_DIR`` names a folder with its ``train.jsonl`` and
``test.jsonl`` (as for ``rlcli``); without it, arithmetic only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402

GSM8K = os.environ.get("RLCLI_GSM8K_DIR")
MODELS = {"tiny": (64, 2), "4-layer": (256, 4)}  # name: (hidden size, layers)


def prompts(env_spec: str, model_dir: str, tasks: int, seed: int):
    """(the prompts `eval rl` sends for these tasks: the env's own initial observations, the
    renderer that reads the answers)."""
    from tinker_cookbook import renderers

    from rlcli import envs
    from rlcli.compat.renderer_choice import resolve_renderer

    name, _, tokenizer = resolve_renderer(model_dir, None)
    renderer = renderers.get_renderer(name, tokenizer)
    env = envs.get(env_spec, gsm8k_dir=GSM8K)

    async def build():
        out = []
        for row in env.problems("test", seed, tasks):
            prompt, _ = await env.make_env(row, renderer).initial_observation()
            out.append(prompt.to_ints())
        return out

    return asyncio.run(build()), renderer


def generate_local(model, ids: list[list[int]], tokens: int, eos: int, pad: int, batch: int):
    """(seconds, tokens generated, each task's tokens) for greedy batched ``generate``."""
    import torch

    out_tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(ids), batch):
        chunk = ids[i : i + batch]
        width = max(len(p) for p in chunk)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=mask, do_sample=False, max_new_tokens=tokens,
                eos_token_id=eos, pad_token_id=pad,
            )  # fmt: skip
        for row in out[:, width:].tolist():
            out_tokens.append(row[: row.index(eos) + 1] if eos in row else row)
    seconds = time.perf_counter() - start
    return seconds, sum(len(t) for t in out_tokens), out_tokens


def generate_engine(engine, ids: list[list[int]], tokens: int, stop: list[int], batch: int):
    """(seconds, tokens generated) for the server's own engine called in-process on the same
    prompts in batches of ``batch``: the server's compute without its request path, which
    tells the batching and HTTP cost apart from the decoding."""
    import numpy as np

    from rlcli.server.engine.sampling import SampleJob

    jobs = [
        SampleJob(
            np.asarray(p, dtype=np.int64), max_tokens=tokens, temperature=0.0, stop_tokens=stop
        )
        for p in ids
    ]
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(jobs), batch):
        outputs.extend(engine.sample(jobs[i : i + batch]))
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.sequences[0][0]) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48, help="max new tokens per task")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--envs", default="arithmetic,gsm8k")
    parser.add_argument("--models", default="tiny,4-layer")
    parser.add_argument("--name", default="eval_throughput")
    args = parser.parse_args()

    from tinker_cookbook.renderers import get_text_content
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcli.client.evaluate import EvalOptions, evaluate
    from rlcli.models.tiny import build_tiny_model

    env_specs = [e for e in args.envs.split(",") if e != "gsm8k" or GSM8K]
    results: dict[str, dict] = {}
    for model_name in args.models.split(","):
        hidden, layers = MODELS[model_name]
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(
                build_tiny_model(Path(tmp) / "m", hidden_size=hidden, num_layers=layers)
            )
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
            model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
            from rlcli.server.engine.core import Engine

            engine = Engine(model_dir, device="cpu")
            with _receipt.local_server(model_dir, tmp, wait=300) as record:
                for spec in env_specs:
                    ids, renderer = prompts(spec, model_dir, args.tasks, seed=0)
                    opts = EvalOptions(
                        env=spec, model=model_dir, base_url=record.base_url, tasks=args.tasks,
                        max_new_tokens=args.tokens, temperature=0.0, seed=0,
                        gsm8k_dir=GSM8K,
                    )  # fmt: skip
                    batch = opts.concurrency
                    evaluate(opts)  # warm up both sides
                    generate_local(model, ids[:4], args.tokens, eos, pad, batch)
                    generate_engine(engine, ids[:4], args.tokens, [eos], batch)
                    load_before = os.getloadavg()[0]  # the machine is shared: say how busy
                    server_runs, local_runs, engine_runs, agree = [], [], [], None
                    for _ in range(args.rounds):
                        t0 = time.perf_counter()
                        result = evaluate(opts)
                        wall = time.perf_counter() - t0
                        server_runs.append(
                            {
                                "seconds": result["seconds"],
                                "wall_seconds_with_setup": wall,
                                "tokens": result["tokens_generated"],
                                "tasks": result["tasks"],
                            }
                        )
                        seconds, tokens, local_tokens = generate_local(
                            model, ids, args.tokens, eos, pad, batch
                        )
                        local_runs.append({"seconds": seconds, "tokens": tokens, "tasks": len(ids)})
                        seconds, tokens = generate_engine(engine, ids, args.tokens, [eos], batch)
                        engine_runs.append(
                            {"seconds": seconds, "tokens": tokens, "tasks": len(ids)}
                        )
                        agree = sum(
                            t["response"] == get_text_content(renderer.parse_response(lt)[0])
                            for t, lt in zip(result["per_task"], local_tokens, strict=True)
                        )

                    def rates(runs):  # median, and best: the least disturbed run
                        return {
                            "best_tasks_per_s": max(r["tasks"] / r["seconds"] for r in runs),
                            "best_tokens_per_s": max(r["tokens"] / r["seconds"] for r in runs),
                            "tasks_per_s": statistics.median(
                                r["tasks"] / r["seconds"] for r in runs
                            ),
                            "tokens_per_s": statistics.median(
                                r["tokens"] / r["seconds"] for r in runs
                            ),
                        }

                    s, lo, en = rates(server_runs), rates(local_runs), rates(engine_runs)
                    key = f"{model_name}/{spec}"
                    results[key] = {
                        "server": {**s, "runs": server_runs},
                        "in_process_generate": {**lo, "runs": local_runs, "batch": batch},
                        "in_process_engine": {**en, "runs": engine_runs, "batch": batch},
                        "ratio_tasks_per_s": s["tasks_per_s"] / lo["tasks_per_s"],
                        "ratio_tokens_per_s": s["tokens_per_s"] / lo["tokens_per_s"],
                        "ratio_best_tasks_per_s": s["best_tasks_per_s"] / lo["best_tasks_per_s"],
                        "tasks_with_the_same_answer": f"{agree}/{len(ids)}",
                        "mean_prompt_tokens": statistics.fmean(len(p) for p in ids),
                        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
                    }
                    print(
                        f"{key}: server {s['tasks_per_s']:.2f} tasks/s "
                        f"{s['tokens_per_s']:.0f} tok/s; generate {lo['tasks_per_s']:.2f} "
                        f"tasks/s {lo['tokens_per_s']:.0f} tok/s; engine in-process "
                        f"{en['tasks_per_s']:.2f} tasks/s; ratio "
                        f"{results[key]['ratio_tasks_per_s']:.2f}x (best runs "
                        f"{results[key]['ratio_best_tasks_per_s']:.2f}x); "
                        f"same answer {agree}/{len(ids)}",
                        flush=True,
                    )
    path = _receipt.write(
        args.name,
        {
            "target": "eval rl tasks/s >= 1x in-process transformers generate (same prompts)",
            "settings": {
                "tasks": args.tasks,
                "max_new_tokens": args.tokens,
                "rounds": args.rounds,
                "greedy": True,
                "models": {m: {"hidden": MODELS[m][0], "layers": MODELS[m][1]} for m in MODELS},
            },
            "results": results,
        },
    )
    print(path)


if __name__ == "__main__":
    main()

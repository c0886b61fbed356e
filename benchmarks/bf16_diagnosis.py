"""Where bf16 RL loses what fp32 keeps: SmolLM2-135M-Instruct, in-process Engine, arithmetic
prompts (the cookbook's few-shot prefix), the RL benchmark's sampling settings.

For each dtype (one process, one after the other, same prompts and seeds):
- sampler vs training logprobs: 4 prompts x 8 rollouts at T 0.8, 24 tokens (one decode batch),
  then the same tokens through ``forward_backward(forward_only)``; |logp_train - logp_sampler|
  per token (mean, p99, max) and the share of ratios outside [0.5, 2]; with a fresh LoRA and
  after one importance-sampling step at lr 3e-4 (so the LoRA is nonzero, as from step 2 on).
- batch composition: each of the 32 rows sampled alone with its seed vs in the batch (rows
  whose tokens differ, first differing position).
- whether a LoRA step survives: the change in training logprobs that one step makes (on fp32
  rollouts, same data, same init) in bf16 vs in fp32: correlation and relative error.

    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/bf16_diagnosis.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_model  # noqa: E402


def prompts(model: Path, n: int) -> list[np.ndarray]:
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv

    from rlcli.compat.renderer_choice import resolve_renderer

    name, _, tokenizer = resolve_renderer(str(model), None)
    renderer = renderers.get_renderer(name, tokenizer)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        x, y = (int(v) for v in rng.integers(0, 101, 2))
        convo = [
            *ArithmeticEnv.standard_fewshot_prefix(),
            {"role": "user", "content": f"What is {x} + {y}?"},
        ]
        out.append(np.asarray(renderer.build_generation_prompt(convo).to_ints(), np.int64))
    return out


def jobs_for(ps, sampler, group, max_tokens, temperature, seed0=0):
    from rlcli.server.engine.sampling import SampleJob

    return [
        SampleJob(
            prompt=p,
            num_samples=group,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed0 + i,
            sampler=sampler,
        )  # fmt: skip
        for i, p in enumerate(ps)
    ]


def rollouts(engine, jobs):
    """[(prompt, tokens, sampler logprobs)] for every row, in job order."""
    for job in jobs:
        engine.add_stops(job)
    (outs,) = [engine._generate(engine._sampler_module(jobs[0].sampler), jobs)]
    rows = []
    for job, out in zip(jobs, outs, strict=True):
        for tokens, logps, _ in out.sequences:
            rows.append((job.prompt, tokens.astype(np.int64), logps))
    return rows


def datums(rows, advantages=None):
    from rlcli.server.wire import DatumArrays

    out = []
    for i, (prompt, tokens, logps) in enumerate(rows):
        full = np.concatenate([prompt, tokens])
        n = len(full) - 1
        adv = np.zeros(n, np.float32)
        lp = np.zeros(n, np.float32)
        start = len(prompt) - 1
        lp[start:] = logps
        if advantages is not None:
            adv[start:] = advantages[i]
        out.append(
            DatumArrays(
                full[:-1],
                {"target_tokens": full[1:], "logprobs": lp, "advantages": adv},
            )
        )
    return out


def train_logprobs(engine, model_id, rows):
    from rlcli.server.wire import DatumArrays

    data = [
        DatumArrays(d.tokens, {"target_tokens": d.inputs["target_tokens"]}) for d in datums(rows)
    ]
    outs, _ = engine.forward_backward(model_id, data, "cross_entropy", forward_only=True)
    return [o["logprobs"][len(p) - 1 :] for o, (p, _, _) in zip(outs, rows, strict=True)]


def mismatch(rows, trained) -> dict:
    d = np.concatenate([np.abs(t - lp) for t, (_, _, lp) in zip(trained, rows, strict=True)])
    log_ratio = np.concatenate([t - lp for t, (_, _, lp) in zip(trained, rows, strict=True)])
    return {
        "tokens": int(d.size),
        "mean": float(d.mean()),
        "p99": float(np.quantile(d, 0.99)),
        "max": float(d.max()),
        "ratio_outside_0.5_2": float((np.abs(log_ratio) > np.log(2)).mean()),
    }


def group_advantages(model, rows, ps, group, answers):
    """Reward 1 if the completion contains the right sum, centred per group (as the cookbook)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rewards = np.array(
        [float(str(answers[i // group]) in tok.decode(t)) for i, (_, t, _) in enumerate(rows)]
    )
    adv = rewards.reshape(-1, group)
    adv = adv - adv.mean(1, keepdims=True)
    if not np.any(adv):  # no signal in this batch: a fixed +-1 pattern
        adv = np.tile(np.array([1.0, -1.0] * (group // 2)), (len(ps), 1))
    return adv.ravel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--alone", type=int, default=8, help="rows re-sampled alone")
    parser.add_argument(
        "--bf16", choices=["mixed", "plain"], default="mixed",
        help="mixed: the engine as it is (precision.py); plain: torch's bf16 Linears (before)",
    )  # fmt: skip
    parser.add_argument("--name", default="bf16_diagnosis")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    args = parser.parse_args()

    from rlcli.server.engine.core import Engine

    model = smollm2_model(args.model)
    ps = prompts(model, args.prompts)
    results: dict = {}
    reference_rows = None
    deltas = {}
    for dtype in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        engine = Engine(str(model), device="cpu", dtype=dtype)
        if args.bf16 == "plain":
            for module in engine.model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.__class__ = torch.nn.Linear
        engine.create_adapter("a", rank=32, seed=0)
        engine.snapshot_sampler("a", "s0", None, {})
        r: dict = {"load_s": time.perf_counter() - t0}
        jobs = jobs_for(ps, "s0", args.group, args.max_tokens, args.temperature)
        t0 = time.perf_counter()
        rows = rollouts(engine, jobs)
        r["sample_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        trained = train_logprobs(engine, "a", rows)
        r["forward_s"] = time.perf_counter() - t0
        r["mismatch_fresh_lora"] = mismatch(rows, trained)
        # batch composition: rows of the first jobs alone, same seeds
        alone_diff, first_diff, lp_diff = 0, [], []
        checked = 0
        for j, job in enumerate(jobs):
            for s in range(job.num_samples):
                if checked >= args.alone:
                    break
                checked += 1
                single = jobs_for([job.prompt], "s0", 1, args.max_tokens, args.temperature, j)[0]
                # row s of job j has seed row_seed(seed, s); alone, num_samples=1 is sample 0:
                # sample s alone needs the same generator, so ask for s+1 samples, keep row s
                single.num_samples = s + 1
                (alone_row,) = rollouts(engine, [single])[s : s + 1]
                batched = rows[j * args.group + s]
                a, b = alone_row[1], batched[1]
                if len(a) != len(b) or not np.array_equal(a, b):
                    alone_diff += 1
                    n = min(len(a), len(b))
                    k = int(np.argmax(a[:n] != b[:n])) if np.any(a[:n] != b[:n]) else n
                    first_diff.append(k)
                n = min(len(a), len(b))
                k = int(np.argmax(a[:n] != b[:n])) if np.any(a[:n] != b[:n]) else n
                if k:
                    lp_diff.append(float(np.abs(alone_row[2][:k] - batched[2][:k]).max()))
        r["batch_composition"] = {
            "rows_checked": checked,
            "rows_whose_tokens_differ_alone_vs_batched": alone_diff,
            "first_differing_position": first_diff,
            "max_abs_logprob_diff_on_shared_prefix": max(lp_diff) if lp_diff else 0.0,
        }
        # one IS step on the fp32 rollouts (same data, same init in both dtypes)
        if reference_rows is None:
            reference_rows = rows
            answers = []
            for p in ps:
                text = engine.tokenizer.decode(p)
                x, y = text.rsplit("What is ", 1)[1].split("?")[0].split(" + ")
                answers.append(int(x) + int(y))
            r_adv = group_advantages(model, rows, ps, args.group, answers)
            results["advantages"] = r_adv.tolist()
        ref_trained = train_logprobs(engine, "a", reference_rows)
        fixed = [(p, t, lp) for (p, t, _), lp in zip(reference_rows, ref_trained, strict=True)]
        data = datums(fixed, np.array(results["advantages"]))
        t0 = time.perf_counter()
        _, metrics = engine.forward_backward("a", data, "importance_sampling")
        engine.optim_step("a", learning_rate=args.lr)
        r["train_step_s"] = time.perf_counter() - t0
        after = train_logprobs(engine, "a", reference_rows)
        deltas[dtype] = np.concatenate([a - b for a, b in zip(after, ref_trained, strict=True)])
        r["step_logprob_change_abs_mean"] = float(np.abs(deltas[dtype]).mean())
        # rollouts from the stepped LoRA: the mismatch as from step 2 of a run
        engine.snapshot_sampler("a", "s1", None, {})
        jobs = jobs_for(ps, "s1", args.group, args.max_tokens, args.temperature, 100)
        rows1 = rollouts(engine, jobs)
        r["mismatch_after_one_step"] = mismatch(rows1, train_logprobs(engine, "a", rows1))
        if dtype == "float32":
            stepped32 = [p.detach().clone() for p in engine.adapters["a"].params]
        else:  # float32's stepped LoRA weights in this forward: does the same update show?
            with torch.no_grad():
                for p, w in zip(engine.adapters["a"].params, stepped32, strict=True):
                    p.copy_(w)
            same = train_logprobs(engine, "a", reference_rows)
            deltas["same_weights"] = np.concatenate(
                [a - b for a, b in zip(same, ref_trained, strict=True)]
            )
        results[dtype] = r
        print(dtype, json.dumps(r, indent=1), flush=True)
        del engine
    d32 = deltas["float32"]

    def against_float32(what: str, other: np.ndarray) -> dict:
        return {
            "what": what,
            "correlation": float(np.corrcoef(d32, other)[0, 1]),
            "relative_error": float(np.linalg.norm(other - d32) / np.linalg.norm(d32)),
            "fp32_abs_mean": float(np.abs(d32).mean()),
            "bf16_abs_mean": float(np.abs(other).mean()),
        }

    results["lora_step_survival"] = against_float32(
        "change of training logprobs on the same fp32 rollouts made by one IS step "
        "(same init, same advantages): bf16 vs fp32",
        deltas["bfloat16"],
    )
    results["lora_same_weights"] = against_float32(
        "float32's LoRA weights after its one IS step, in the bf16 forward: change of "
        "training logprobs vs the change in float32",
        deltas["same_weights"],
    )
    print(json.dumps(results["lora_step_survival"], indent=1))
    print(json.dumps(results["lora_same_weights"], indent=1))
    cpu = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln]
    flags = set(Path("/proc/cpuinfo").read_text().split())
    results["cpu"] = {
        "model": cpu[0].split(":", 1)[1].strip() if cpu else None,
        "bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
    }
    results["config"] = vars(args)
    results["machine_cpu"] = _receipt.cpu_model()
    print("->", _receipt.write(args.name, results))


if __name__ == "__main__":
    main()

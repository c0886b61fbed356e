"""The TRL side of ``trl_peer.py``: TRL's ``GRPOTrainer`` or ``SFTTrainer`` for a few steps on
the data ``trl_peer.py`` wrote, timing every optimizer step; prints one JSON line.

Runs in its own venv (TRL may move transformers; it never enters the project venv), so it
imports nothing from rlcli. Settings are TRL's defaults except what the comparison fixes:
LoRA rank and alpha and targets, batch, token budget, learning rate, one optimizer step per
batch, no KL term, no checkpoints, no logging services.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import resource
import time
from importlib.metadata import version


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), as the cookbook extracts it."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def number(text: str | None) -> float | None:
    try:
        return float(re.sub(r"[,$\s]", "", text or ""))
    except ValueError:
        return None


def gsm8k_reward(completions, answer, **_) -> list[float]:
    """1 for the right number in ``\\boxed{}``, else 0 (the cookbook's MathEnv, less its format
    penalty)."""
    out = []
    for completion, truth in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        got = number(boxed_answer(text))
        out.append(1.0 if got is not None and got == number(truth) else 0.0)
    return out


def cpu_has_bf16() -> bool:
    """The rule of rlcli's ``--dtype auto`` (server/engine/core.py): bf16 only where the CPU
    computes in it; elsewhere bf16 is emulated and several times slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def pick_precision(asked: str) -> tuple[str, str]:
    """(precision, why): ``auto`` and ``bf16`` follow rlcli's rule, so both sides compute in
    the same precision; ``fp32`` is fp32."""
    if asked == "fp32":
        return "fp32", "asked"
    if cpu_has_bf16():
        return "bf16", "this CPU computes in bf16 (as rlcli --dtype auto decides)"
    return "fp32", f"{asked} asked; this CPU has no bf16 arithmetic, so fp32 as rlcli's engine"


class StepTimes:
    """Seconds of every optimizer step (generation included, for GRPO), as a TrainerCallback."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        outer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                outer.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                outer.times.append(time.perf_counter() - outer.t0)

        self.times: list[float] = []
        self.callback = _Callback()


class GenerateTimes:
    """Seconds spent in ``generate`` within each optimizer step (GRPO's sampling share):
    ``GenerationMixin.generate`` wrapped, added up between a step's begin and end."""

    def __init__(self) -> None:
        from transformers import GenerationMixin, TrainerCallback

        outer, original = self, GenerationMixin.generate
        self.current, self.times = 0.0, []

        def generate(model, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(model, *args, **kwargs)
            finally:
                outer.current += time.perf_counter() - t0

        GenerationMixin.generate = generate

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                outer.current = 0.0

            def on_step_end(self, args, state, control, **kwargs):
                outer.times.append(outer.current)

        self.callback = _Callback()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["grpo", "sft"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="JSONL from trl_peer.py")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256, help="GRPO: new tokens per answer")
    parser.add_argument("--max-length", type=int, default=256, help="SFT: tokens per sequence")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--targets", required=True, help="comma-separated LoRA target modules")
    parser.add_argument("--lr", type=float, default=4e-5)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()

    import torch
    from datasets import load_dataset
    from peft import LoraConfig

    precision, note = pick_precision(args.precision)
    torch.manual_seed(0)
    data = load_dataset("json", data_files=args.data, split="train")
    peft_config = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
        target_modules=args.targets.split(","), task_type="CAUSAL_LM",
    )  # fmt: skip
    common = dict(
        output_dir=args.output_dir, use_cpu=True, bf16=precision == "bf16",
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        learning_rate=args.lr, max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    timer, generation = StepTimes(), GenerateTimes()
    if args.mode == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(
            **common, num_generations=args.group_size, max_completion_length=args.max_tokens,
            steps_per_generation=1, num_iterations=1,
            beta=0.0, temperature=1.0, shuffle_dataset=False,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=args.model, reward_funcs=gsm8k_reward, args=config, train_dataset=data,
            peft_config=peft_config, callbacks=[timer.callback, generation.callback],
        )  # fmt: skip
    else:
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**common, max_length=args.max_length, packing=False)
        trainer = SFTTrainer(
            model=args.model, args=config, train_dataset=data, peft_config=peft_config,
            callbacks=[timer.callback],
        )  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - started
    logs = [row for row in trainer.state.log_history if "loss" in row]
    keep = ("loss", "reward", "completions/mean_length", "completions/clipped_ratio", "num_tokens")
    settings = (
        "bf16", "gradient_checkpointing", "per_device_train_batch_size",
        "gradient_accumulation_steps", "learning_rate", "loss_type", "beta", "num_generations",
        "max_completion_length", "scale_rewards", "epsilon", "max_length", "packing",
        "assistant_only_loss", "completion_only_loss", "padding_free",
    )  # fmt: skip
    packages = ("trl", "transformers", "peft", "torch", "accelerate", "datasets")
    result = {
        "step_time_s": timer.times,
        "generate_s": generation.times,  # GRPO: sampling seconds within each step
        "train_s": train_s,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "logs": [{k: row[k] for k in keep if k in row} for row in logs],
        "settings": {k: getattr(config, k) for k in settings if hasattr(config, k)},
        "precision": precision,
        "precision_note": note,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in packages},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

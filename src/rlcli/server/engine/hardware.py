"""What the engine runs on, picked from the machine: device, dtype, micro-batch size and when
to checkpoint layers (``serve start``'s ``auto`` defaults, documented in docs/server-engine.md)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

# Padded tokens per forward/backward pass: bounds activation memory (a 30-layer 135M model
# holds about 2.7 MB per token for the backward pass in float32 without gradient
# checkpointing, about half in bf16 (``activations.py``), about 0.1 MB with it). A GPU
# checkpoints and takes ``MICROBATCH_TOKENS``; a CPU does not checkpoint and takes
# ``CPU_MICROBATCH_TOKENS`` (pick_microbatch_tokens).
MICROBATCH_TOKENS = 4096
CPU_MICROBATCH_TOKENS = 512  # an RL prompt and a 256-token answer


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The base weights' dtype, which is the compute dtype of training and sampling alike.

    ``auto`` is bfloat16 where the hardware computes in it (a CUDA device with bf16, a CPU with
    AVX512-BF16 or AMX) and float32 elsewhere: on an AVX2-only CPU bf16 matmuls are emulated
    and ~6x slower than float32. LoRA weights and optimizer state stay float32 (peft's
    ``autocast_adapter_dtype``), and so does everything but the base weights' matmuls
    (``precision.py``)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if device.type == "cpu" and cpu_has_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def pick_microbatch_tokens(tokens: int | None, device: torch.device) -> int:
    """``--microbatch-tokens``, or the device's default.

    A GPU: ``MICROBATCH_TOKENS``, every micro-batch checkpointed (``checkpoint_above``). A CPU
    does not checkpoint and takes ``CPU_MICROBATCH_TOKENS`` in every dtype and on every machine,
    so a step's peak is the same wherever it runs. Larger ones buy little on a CPU: SmolLM2's
    8 x 256-token SFT step in bf16 took 7.8 s at 3.34 GB of engine peak in 1024-token
    micro-batches and 8.8 s at 2.52 GB in 512-token ones (``sft_step_smollm2.json``); until
    2026-12-04 bf16 took 1024, and until 2026-12-03 as many as half the free memory held, up to
    4096 (5.7 GB on a 23 GB machine). In float32, 4096 gained ~1.1x for twice the memory."""
    if tokens is not None:
        if tokens < 1:
            raise ValueError(f"microbatch_tokens must be at least 1, got {tokens}")
        return tokens
    return MICROBATCH_TOKENS if device.type != "cpu" else CPU_MICROBATCH_TOKENS


def checkpoint_above(mode: bool | None, device: torch.device, microbatch_tokens: int) -> float:
    """Padded tokens above which a micro-batch's layers are recomputed in backward.

    On (True): always (0). Off (False): never. Auto (None): always on a GPU, where memory is
    what runs out; on a CPU only for a micro-batch over the token budget (a single row longer
    than it), since there recomputing costs half again the step (a LoRA backward is about one
    forward) and small micro-batches bound memory at no cost."""
    if mode is None:
        return microbatch_tokens if device.type == "cpu" else 0
    return 0 if mode else math.inf


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (Linux ``/proc/cpuinfo`` flags; elsewhere no)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(text.split()))

"""What the engine runs on, picked from the machine: device, dtype, micro-batch size and when
to checkpoint layers (``serve start``'s ``auto`` defaults, documented in docs/server-engine.md)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

# Padded tokens per forward/backward pass: bounds activation memory (a 30-layer 135M model
# holds about 2.7 MB per token for the backward pass in float32 without gradient
# checkpointing, about half in bf16 (``activations.py``), about 0.1 MB with it). A GPU
# checkpoints and takes the ceiling; a CPU does not checkpoint and takes the floor in float32,
# ``CPU_BF16_MICROBATCH_TOKENS`` in bf16 (pick_microbatch_tokens).
MICROBATCH_TOKENS = 4096  # the default's ceiling
MIN_CPU_MICROBATCH_TOKENS = 512  # the CPU default's floor: an RL prompt and a 256-token answer
CPU_BF16_MICROBATCH_TOKENS = 1024


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


def pick_microbatch_tokens(
    tokens: int | None,
    device: torch.device,
    token_bytes: int = 0,
    spare_bytes: int = 0,
    dtype: torch.dtype = torch.float32,
) -> int:
    """``--microbatch-tokens``, or the device's default.

    A GPU: ``MICROBATCH_TOKENS``, every micro-batch checkpointed (``checkpoint_above``). A
    CPU does not checkpoint. In bf16 it takes ``CPU_BF16_MICROBATCH_TOKENS``, or fewer where
    their activations (``token_bytes`` each, ``activation_bytes_per_token``) would not fit in
    half of ``spare_bytes`` (memory free with the model loaded), in steps of 512 and at least
    ``MIN_CPU_MICROBATCH_TOKENS``. A fixed size, not what free memory allows: the step's peak
    is then the same on every machine (SmolLM2's 8 x 256-token SFT step peaked at 5.7 GB in
    the 4096-token micro-batches a large machine gave it). In float32 it takes
    ``MIN_CPU_MICROBATCH_TOKENS``: there 4096 gained ~1.1x (13.2 vs 11.8 s) for twice the
    memory."""
    if tokens is not None:
        if tokens < 1:
            raise ValueError(f"microbatch_tokens must be at least 1, got {tokens}")
        return tokens
    if device.type != "cpu":
        return MICROBATCH_TOKENS
    if dtype == torch.float32:
        return MIN_CPU_MICROBATCH_TOKENS
    fits = spare_bytes // 2 // max(token_bytes, 1)
    return int(min(CPU_BF16_MICROBATCH_TOKENS, max(MIN_CPU_MICROBATCH_TOKENS, fits // 512 * 512)))


def activation_bytes_per_token(config) -> int:
    """An estimate of what a training forward keeps for the backward, per token: float32
    copies of ~12 hidden-wide and ~8 MLP-wide vectors per layer (the layers' float32
    results, and peft's float32 casts of each LoRA input), and the output layer's float32
    softmax (``logprobs.py``) with room for its temporaries. Measured on SmolLM2 (30 layers,
    576 / 1536 wide, 49k vocabulary): 2.7 MB a token in bf16; this gives 2.7."""
    config = getattr(config, "text_config", None) or config
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    wide = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    return (layers * (12 * hidden + 8 * wide) + 2 * vocab) * 4


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

"""What a bf16 model's training forward keeps for its backward: bf16 copies, not float32.

A bf16 engine computes in float32 everywhere but its matmuls (``precision.py``), so every
activation the backward needs (each LoRA layer's input, the norms' inputs, the MLP's gate and
up products, the output layer's softmax) was kept in float32: on SmolLM2 1.5 MB a token, which
made the CPU's bf16 micro-batches of 4096 tokens peak at 9 GB. Under ``compact()`` each of them
is kept as a bf16 copy and turned back into float32 when the backward reads it: half the
memory, and the same forward arithmetic (the logprobs and the loss are unchanged). Only the
gradients read the rounded copies, as in any bf16 training (a relative 2^-9 per factor; the
LoRA update and its sign are what bf16 rounding threatened, and those stay float32).

Attention keeps its float32 inputs (``exact()``, which ``attention.py`` wraps around it): its
backward recomputes the softmax from queries, keys and the forward's logsumexp, and rounding
queries and keys would move that softmax by a few percent at large logits. Weights and buffers
are never copied. A tensor saved by several nodes (the input of q, k and v) is copied once.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

MIN_ELEMENTS = 1 << 14  # smaller tensors (RoPE tables, per-row scalars) stay as they are


class _Compactor:
    """The pack/unpack pair of one ``compact()`` region, and its copies by source tensor."""

    def __init__(self, keep: set[int]) -> None:
        self.keep = keep  # storage addresses of the model's own tensors
        # (address, shape, strides) -> (the source's base, its version, the bf16 copy); the
        # weak reference tells a live source from a new tensor at a freed address
        self.copies: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}

    def pack(self, t: torch.Tensor):
        if (
            t.dtype != torch.float32
            or t.numel() < MIN_ELEMENTS
            or t.untyped_storage().data_ptr() in self.keep
            or isinstance(t, torch.nn.Parameter)
        ):
            return t
        base = t._base if t._base is not None else t
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        hit = self.copies.get(key)
        if hit is not None and hit[0]() is base and hit[1] == t._version:
            return hit[2]
        copy = _Packed(t.to(torch.bfloat16))
        self.copies[key] = (weakref.ref(base), t._version, copy)
        return copy

    @staticmethod
    def unpack(saved):
        return saved.tensor.float() if isinstance(saved, _Packed) else saved


class _Packed:
    """A bf16 copy that stands for a float32 tensor (unpacked back to float32)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def model_storages(model: torch.nn.Module) -> set[int]:
    """Storage addresses of a model's parameters and buffers (never copied)."""
    tensors = [*model.parameters(), *model.buffers()]
    return {t.untyped_storage().data_ptr() for t in tensors}


@contextlib.contextmanager
def compact(keep: set[int]) -> Iterator[None]:
    """Within it, float32 tensors saved for the backward are kept as bf16 copies (module
    docstring); ``keep``: storages never copied (``model_storages``)."""
    packer = _Compactor(keep)
    with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
        try:
            yield
        finally:
            packer.copies.clear()  # the graph holds what it needs; drop the index


def exact() -> contextlib.AbstractContextManager:
    """Within it, tensors are saved as they are (inside ``compact()``: attention's inputs)."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(t):
    return t

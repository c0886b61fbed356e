"""Target logprobs from final hidden states, a chunk of positions at a time.

The plain way (``model(...).logits.float().log_softmax(-1)``) holds ``[tokens, vocab]`` float32
logits, their log-softmax and, in the backward, a scattered one-hot gradient and a softmax, for
the whole micro-batch: 2048 tokens x 49k vocabulary is 0.4 GB per copy, and each is a pass over
memory. Here the output head runs on ``CHUNK_TOKENS`` positions at a time, and ``_PickLogprob``
keeps one tensor per chunk for the backward, the softmax, whose gradient it writes in place
(``g * (onehot - softmax)``): no logits, one-hot or second softmax are kept or made.

Where memory is tight (``recompute``: the engine's checkpointed micro-batches) each chunk also
sits under ``torch.utils.checkpoint``, so its softmax is dropped after the forward and the
chunk's head is run again in the backward: peak memory holds one chunk's. Otherwise the
softmax is kept, 4 bytes per vocabulary entry per token, and the head runs twice (forward, and
its backward) instead of three times: SmolLM2, 2,500 tokens in bf16, 3.1 -> ~2 s.

The arithmetic per position is the plain way's (head in the model's dtype, then float32
``logsumexp``), so results match it to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 128  # positions per head call: 128 x 49k float32 logits is 25 MB


def target_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    chunk: int | None = None,
    recompute: bool = True,
) -> torch.Tensor:
    """``hidden`` [N, H], ``targets`` [N] or [N, K] -> float32 log p(target), shaped like
    ``targets``. ``head`` maps hidden states to logits (the model's output layer);
    ``recompute``: run it again in the backward rather than keep each chunk's softmax."""
    chunk = chunk or CHUNK_TOKENS
    checkpointed = recompute and torch.is_grad_enabled()
    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if checkpointed:
            pieces.append(checkpoint(_chunk, head, h, t, use_reentrant=False))
        else:
            pieces.append(_chunk(head, h, t))
    if not pieces:
        return hidden.new_zeros(targets.shape, dtype=torch.float32)
    return torch.cat(pieces)


def _chunk(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    if not torch.is_grad_enabled() or not logits.requires_grad:
        return _pick(logits, targets, logits.logsumexp(-1, keepdim=True))
    return _PickLogprob.apply(logits, targets)


def _pick(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``logits[target] - lse`` shaped like ``targets`` ([n] or [n, K])."""
    picked = logits.gather(-1, targets.view(targets.shape[0], -1)) - lse
    return picked.view(targets.shape)


class _PickLogprob(torch.autograd.Function):
    """``logits`` [n, V] float32, ``targets`` [n] or [n, K] -> ``logits[target] - logsumexp``,
    keeping only the softmax for the backward: d/d logits = g_target one-hot - (sum g) softmax,
    written into the kept softmax in place (it is used once)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logsumexp and softmax from one exp: 5 passes over the chunk, not logsumexp's 4
        # then a subtraction and an exp into two more new tensors
        top = logits.amax(-1, keepdim=True)
        softmax = torch.sub(logits, top).exp_()
        total = softmax.sum(-1, keepdim=True)
        softmax.div_(total)
        ctx.save_for_backward(softmax, targets)
        return _pick(logits, targets, top + total.log())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, targets = ctx.saved_tensors
        targets = targets.view(targets.shape[0], -1)
        grad = grad.reshape(targets.shape)
        grad_logits = softmax.mul_(-grad.sum(-1, keepdim=True))
        grad_logits.scatter_add_(-1, targets, grad)
        return grad_logits, None

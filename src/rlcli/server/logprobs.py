"""Target logprobs from final hidden states, a chunk of positions at a time.

The plain way (``model(...).logits.float().log_softmax(-1)``) holds ``[tokens, vocab]`` float32
logits, and their softmax for the backward pass, for the whole micro-batch: 2048 tokens x 49k
vocabulary is 0.4 GB per copy. Here the output head runs on ``CHUNK_TOKENS`` positions at a time
and, when gradients are wanted, each chunk sits under ``torch.utils.checkpoint``: its logits are
dropped after the forward and recomputed in the backward, so peak memory holds one chunk's.
The arithmetic per position is the plain way's (head in the model's dtype, then float32
``logsumexp`` and ``gather``), so results match it to float rounding.
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
) -> torch.Tensor:
    """``hidden`` [N, H], ``targets`` [N] or [N, K] -> float32 log p(target), shaped like
    ``targets``. ``head`` maps hidden states to logits (the model's output layer)."""
    chunk = chunk or CHUNK_TOKENS
    grad = torch.is_grad_enabled()
    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if grad:
            pieces.append(checkpoint(_chunk, head, h, t, use_reentrant=False))
        else:
            pieces.append(_chunk(head, h, t))
    if not pieces:
        return hidden.new_zeros(targets.shape, dtype=torch.float32)
    return torch.cat(pieces)


def _chunk(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    lse = logits.logsumexp(-1, keepdim=True)
    if targets.dim() == 1:
        return (logits.gather(-1, targets.unsqueeze(-1)) - lse).squeeze(-1)
    return logits.gather(-1, targets) - lse

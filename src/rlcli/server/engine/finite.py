"""Invariant 1: no non-finite value ever reaches an adapter or its optimizer state.

This module owns it. Gradients of a ``forward_backward`` are staged in fresh buffers and
merged into the adapter's accumulated gradients only when the loss and every gradient are
finite; an ``optim_step`` runs only on finite gradients and is undone if it would leave a
non-finite weight or optimizer moment (an absurd learning rate, an overflow). A refused step
is a user error and changes nothing.
"""

from __future__ import annotations

import contextlib
import math

import torch

from rlcli.server.errors import UserError

HINT = "check the request's logprobs, advantages, weights and loss_fn_config"


def check_finite(value: float, what: str) -> None:
    if not math.isfinite(value):
        raise UserError(f"{what} is {value} (not finite); nothing was applied: {HINT}")


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _norm(tensors) -> float:
    """The global L2 norm as ``clip_grad_norm_`` computes it (inf if it overflows)."""
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([t.norm() for t in tensors])))


@contextlib.contextmanager
def staged_gradients(params: list[torch.nn.Parameter]):
    """Backward passes inside the block write into fresh gradient buffers; on a clean exit
    they are added to what the adapter had accumulated, but only if the sum is finite and
    so is its norm (an optimizer step could not use it otherwise). On any error the
    adapter's gradients are left exactly as they were."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
        merged = []
        for p, grad in zip(params, saved, strict=True):
            if grad is not None:
                merged.append(grad if p.grad is None else p.grad + grad)
            elif p.grad is not None:
                merged.append(p.grad)
            else:
                merged.append(None)
        present = [g for g in merged if g is not None]
        if not _all_finite(present) or not math.isfinite(_norm(present)):
            raise UserError(f"the gradient is not finite; nothing was applied: {HINT}")
    except BaseException:
        for p, grad in zip(params, saved, strict=True):
            p.grad = grad
        raise
    for p, grad in zip(params, merged, strict=True):
        p.grad = grad


def guarded_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, undone if it leaves any weight or moment non-finite."""
    before = [p.detach().clone() for p in params]
    state_before = {
        id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
        for p in params
        if p in optimizer.state
    }
    try:
        optimizer.step()
        failure = None
    except RuntimeError as e:  # e.g. "value cannot be converted to type float without overflow"
        failure = e
    moments = [v for p in params for v in optimizer.state[p].values() if torch.is_tensor(v)]
    if failure is None and _all_finite(params) and _all_finite(moments):
        return
    with torch.no_grad():
        for p, old in zip(params, before, strict=True):
            p.copy_(old)
    for p in params:
        if id(p) in state_before:
            optimizer.state[p] = state_before[id(p)]
        else:
            optimizer.state.pop(p, None)
    why = f"failed ({failure})" if failure else "would make the weights or moments non-finite"
    raise UserError(f"this optim_step {why} (learning_rate too large?); it was undone")

"""The output layer and its LoRA as one product, for training's logprobs.

peft computes a LoRA layer as ``base(x) + lora_B(lora_A(x)) * scaling``. For the output layer
that makes three more passes over a [tokens, vocabulary] float32 tensor (the delta, its
scaling, the sum) and, in the backward, a fourth (the gradient's scaling): on SmolLM2 (49k
vocabulary, the cookbook's ``train_unembed`` default adapts the output layer) about a tenth
of an RL forward_backward. Here the delta is added by the matmul that makes it (``addmm_``
into the base logits, the scaling as its ``alpha``), and the backward computes the three
gradients directly: peft's arithmetic, summed in another order (identical at scaling 1).

``fused(module)`` is None wherever peft would do anything else (no or several active
adapters, dropout, DoRA or another variant, a merged or disabled adapter, a LoRA bias, a base
layer that is not a plain or ``precision.Float32Head`` ``Linear``): the module runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlcli.server.precision import Float32Head


def fused(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``hidden -> logits`` for the output layer ``module`` (a peft LoRA layer) with its
    active adapter's LoRA in the product, or None where that is not peft's arithmetic."""
    from peft.tuners.lora import Linear as LoraLinear

    if type(module) is not LoraLinear or module.disable_adapters or module.merged:
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1 or active[0] in getattr(module, "lora_variant", {}):
        return None
    name = active[0]
    a, b = module.lora_A[name], module.lora_B[name]
    if a.bias is not None or b.bias is not None:
        return None
    if not isinstance(module.lora_dropout[name], torch.nn.Identity):
        return None
    base = module.base_layer
    if isinstance(base, Float32Head):
        weight32, weight = base.weight32, base.weight
    elif type(base) is torch.nn.Linear and base.weight.dtype == torch.float32:
        weight32 = weight = base.weight
    else:
        return None
    if a.weight.dtype != torch.float32 or b.weight.dtype != torch.float32:
        return None
    bias = None if base.bias is None else base.bias.float()
    scaling = float(module.scaling[name])

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        return _HeadWithLora.apply(
            hidden.float(), weight32, weight, bias, a.weight, b.weight, scaling
        )

    return logits


class _HeadWithLora(torch.autograd.Function):
    """``x W32^T (+ bias) + scaling (x A^T) B^T``, the LoRA term added by one ``addmm_``.
    The backward takes the hidden states' gradient through ``weight`` (a bf16 model's bf16
    weight, as ``precision._HeadProduct`` does; a float32 model's own) plus the LoRA path's,
    and A's and B's gradients; the base weight is frozen."""

    @staticmethod
    def forward(ctx, x, weight32, weight, bias, lora_a, lora_b, scaling):
        t = F.linear(x, lora_a)  # [n, rank]
        out = F.linear(x, weight32, bias)
        out.addmm_(t, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x, weight, lora_a, lora_b, t)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, lora_a, lora_b, t = ctx.saved_tensors
        scaling = ctx.scaling
        grad_t = (grad @ lora_b).mul_(scaling)  # [n, rank]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad.to(weight.dtype) @ weight).float().addmm_(grad_t, lora_a)
        grad_a = grad_t.t() @ x if ctx.needs_input_grad[4] else None
        grad_b = (grad.t() @ t).mul_(scaling) if ctx.needs_input_grad[5] else None
        return grad_x, None, None, None, grad_a, grad_b, None

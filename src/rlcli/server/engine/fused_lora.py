"""A LoRA layer's output as one product, for training.

peft computes a LoRA ``Linear`` as ``base(x) + lora_B(lora_A(x)) * scaling``: after the base
matmul, three more passes over the [tokens, out] output (the LoRA delta, its scaling, the
sum), and in the backward a fourth (the gradient's scaling), each a new tensor as large as
the output: for the output layer, [tokens, 49k] float32 on SmolLM2 (the cookbook's
``train_unembed`` default adapts it). Without them a bf16 forward_backward of 16 RL rows took
9.4-9.5 s instead of 10.3-10.7, at a peak RSS of 10.0 GB instead of 13.4.

``FusedLoraLinear`` (the class of every peft LoRA ``Linear`` once ``install`` has run, as
``precision.mixed_precision`` re-classes the base layers) adds the LoRA term with the matmul
that makes it (``addmm_`` into the base output, the scaling as its ``alpha``) and writes the
backward out: peft's arithmetic, summed in another order (identical at scaling 1). The base
layer's own arithmetic is kept (``precision.Bf16Linear``: bf16 matmul, float32 result;
``Float32Head``: float32 forward, gradient through the bf16 weight). Wherever peft would do
anything else (no or several active adapters, dropout in training mode, DoRA or another
variant, a merged or disabled adapter, a LoRA bias, a trained base weight, another kind of
base layer) it runs peft's own forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rlcli.server.engine.precision import Bf16Linear, Float32Head


def install(model: torch.nn.Module) -> int:
    """Re-class ``model``'s peft LoRA ``Linear`` layers as ``FusedLoraLinear`` (those peft
    has just added too: idempotent); returns how many changed."""
    fused = fused_class()
    (lora_linear,) = fused.__bases__
    changed = 0
    for module in model.modules():
        if type(module) is lora_linear:
            module.__class__ = fused
            changed += 1
    return changed


@functools.cache
def fused_class() -> type:
    """``FusedLoraLinear``, made on first use: peft's import (~2 s) waits for an adapter."""
    from peft.tuners.lora import Linear as LoraLinear

    class FusedLoraLinear(LoraLinear):
        """peft's LoRA ``Linear``, the LoRA term added by its own matmul (module docstring)."""

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            plan = None if args or kwargs else _plan(self)
            if plan is None:
                return super().forward(x, *args, **kwargs)
            return _LoraProduct.apply(x, *plan)

    return FusedLoraLinear


def _plan(layer) -> tuple | None:
    """(forward weight, backward weight, bias, A, B, scaling) where the fused product is
    peft's arithmetic; None where peft's forward must run."""
    if layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    name = active[0]
    a, b = layer.lora_A[name], layer.lora_B[name]
    if a.bias is not None or b.bias is not None:
        return None
    if a.weight.dtype != torch.float32 or b.weight.dtype != torch.float32:
        return None
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, torch.nn.Identity) and (
        type(dropout) is not torch.nn.Dropout or dropout.training
    ):
        return None  # (a Dropout in eval mode, as the engine's model is, passes x through)
    base = layer.base_layer
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return None  # the product's backward gives the base layer no gradient
    float32 = type(base) is torch.nn.Linear and base.weight.dtype == torch.float32
    if type(base) is Float32Head:
        bias = None if base.bias is None else base.bias.float()
        weights = (base.weight32, base.weight, bias)
    elif float32 or type(base) is Bf16Linear:
        weights = (base.weight, base.weight, base.bias)
    else:
        return None
    return (*weights, a.weight, b.weight, float(layer.scaling[name]))


class _LoraProduct(torch.autograd.Function):
    """``base(x) + scaling (x A^T) B^T``, float32, the LoRA term added by one ``addmm_``.

    The base product is the base layer's: the input cast to ``weight``'s dtype, the result
    float32. The backward takes the input's gradient through ``backward_weight`` (the
    low-precision weight, cast as the base layer's own backward does) plus the LoRA path's,
    and A's and B's gradients; the base weight and bias are frozen."""

    @staticmethod
    def forward(ctx, x, weight, backward_weight, bias, lora_a, lora_b, scaling):
        shape = x.shape
        x32 = x.reshape(-1, shape[-1]).float()  # peft casts the LoRA input to A's dtype
        out = F.linear(x32.to(weight.dtype), weight, bias).float()
        t = F.linear(x32, lora_a)  # [n, rank]
        out.addmm_(t, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x32, backward_weight, lora_a, lora_b, t)
        ctx.scaling, ctx.x_shape, ctx.x_dtype = scaling, shape, x.dtype
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x32, weight, lora_a, lora_b, t = ctx.saved_tensors
        scaling = ctx.scaling
        grad = grad.reshape(-1, grad.shape[-1])
        grad_t = (grad @ lora_b).mul_(scaling)  # [n, rank]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad.to(weight.dtype) @ weight).float().addmm_(grad_t, lora_a)
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        grad_a = grad_t.t() @ x32 if ctx.needs_input_grad[4] else None
        grad_b = (grad.t() @ t).mul_(scaling) if ctx.needs_input_grad[5] else None
        return grad_x, None, None, None, grad_a, grad_b, None

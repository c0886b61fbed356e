"""bf16 base weights without losing the LoRA update: bf16 matmuls, float32 everything else.

With bf16 weights, every ``Linear`` returns a bf16 tensor: its float32 accumulator rounded to
the bf16 grid (8 significant bits). peft adds the LoRA branch (float32) to that rounded output
and rounds the sum to bf16 again; the base output is already on the grid, so a LoRA delta
below half a bf16 step of the value it is added to is rounded away, deterministically. A
LoRA's first steps are exactly that small: on SmolLM2 the logprob change one RL step makes,
computed with the same LoRA weights, was half as large in bf16 as in float32 (0.070 vs 0.135
mean per token, correlation 0.78: benchmarks/results/bf16_diagnosis_before.json), so bf16 RL
moved the policy at about half the learning rate, and noisily. The logits too sat on the bf16
grid (a step of 0.125 at |logit| 16..32), which set the sampler/trainer logprob mismatch at
~0.04 per token on average.

``mixed_precision(model)`` changes the class of each bf16 ``nn.Linear`` (before peft wraps
them, so peft's LoRA layers wrap these):
- ``Bf16Linear``: the matmul in bf16 (the weight's dtype; the input cast to it), its result
  returned in float32. peft then adds the LoRA branch in float32 and keeps float32, and the
  residual stream, norms, attention and KV cache run in float32; the weights (what the memory
  traffic of a decode step is) stay bf16 and so do the matmuls' FLOPs.
- ``Float32Head`` for the output layer: logits in float32 from a float32 copy of its weight
  (one extra copy of the unembedding: 113 MB for SmolLM2's 49k x 576), so logprobs are not
  quantised by the logits' bf16 grid. Its backward takes the hidden states' gradient through
  the bf16 weight, as every layer below does (``_HeadProduct``).
The same modules serve training and sampling, so both get the same arithmetic. A float32
model is left as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Bf16Linear(torch.nn.Linear):
    """A ``Linear`` with low-precision weights whose result is float32 (exactly the rounded
    matmul, upcast), so what is added to it afterwards (a LoRA branch) is not rounded away."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()


class Float32Head(torch.nn.Linear):
    """The output layer in float32 from a float32 copy of its (frozen) weight."""

    weight32: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return _HeadProduct.apply(x.float(), self.weight32, self.weight, bias)


class _HeadProduct(torch.autograd.Function):
    """The output layer's product: float32 in the forward; in the backward, the hidden
    states' gradient through the low-precision weight (bf16 in, bf16 out), as every layer
    below takes its gradient (``Bf16Linear``'s backward is a bf16 matmul): no precision the
    layers below would keep is lost, and the 49k-wide product, the backward's largest, runs
    on the CPU's bf16 units (AMX) instead of in float32. The weight is frozen: no gradient
    of its own."""

    @staticmethod
    def forward(ctx, x, weight32, weight, bias):
        ctx.save_for_backward(weight)
        return F.linear(x, weight32, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return (grad.to(weight.dtype) @ weight).float(), None, None, None


def mixed_precision(model: torch.nn.Module) -> int:
    """Turn a low-precision model's Linears into ``Bf16Linear`` (the output layer into
    ``Float32Head``); returns how many changed. Call before any LoRA wraps them."""
    output = model.get_output_embeddings()
    changed = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype == torch.float32:
            continue
        if module is output:
            with torch.no_grad():
                weight32 = module.weight.detach().float()
            module.register_buffer("weight32", weight32, persistent=False)
            module.__class__ = Float32Head
        else:
            module.__class__ = Bf16Linear
        changed += 1
    return changed

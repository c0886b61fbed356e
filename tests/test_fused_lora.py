"""A LoRA layer's output as one product (``fused_lora``) against peft's own forward and
backward, in float32 and bf16, and the cases where it must step aside."""

from __future__ import annotations

import pytest
import torch

from rlcli.server.engine import fused_lora
from rlcli.server.engine.core import Engine


def _engine(model, dtype: str) -> Engine:
    engine = Engine(str(model), device="cpu", dtype=dtype, grad_checkpointing=False)
    engine.create_adapter("student", rank=4, seed=0, alpha=6.0)  # scaling 1.5: not 1
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at 0: make the LoRA term count
        for p in engine.adapters["student"].params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    engine._set_adapter("student")
    return engine


def _output_and_gradients(forward, layer, hidden, g) -> tuple[torch.Tensor, ...]:
    """``forward(layer, x)`` and the gradients of ``(out * g).sum()`` for x, A and B."""
    x = hidden.clone().requires_grad_()
    out = forward(layer, x)
    a, b = layer.lora_A["student"].weight, layer.lora_B["student"].weight
    return (out.detach(), *torch.autograd.grad((out * g).sum(), (x, a, b)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_lora_layer_gives_pefts_output_and_gradients(tiny_model, dtype):
    """The output layer, a projection fed the bf16 embedding (layer 0's q_proj in a bf16
    model) and one fed float32: output, and the input's, A's and B's gradients."""
    engine = _engine(tiny_model, dtype)
    fused = fused_lora.fused_class()
    (peft_linear,) = fused.__bases__
    layers = engine.model.model.layers
    cases = {
        "lm_head": (engine.model.get_output_embeddings(), torch.float32),
        "q_proj": (layers[0].self_attn.q_proj, engine.model.dtype),
        "down_proj": (layers[-1].mlp.down_proj, torch.float32),
    }
    gen = torch.Generator().manual_seed(2)
    for where, (layer, x_dtype) in cases.items():
        assert type(layer) is fused and layer.scaling["student"] == 1.5, where
        assert fused_lora._plan(layer) is not None, where
        hidden = torch.randn(2, 5, layer.in_features, generator=gen).to(x_dtype)
        g = torch.randn(2, 5, layer.out_features, generator=gen)
        got = _output_and_gradients(fused.forward, layer, hidden, g)
        ref = _output_and_gradients(peft_linear.forward, layer, hidden, g)
        assert got[0].dtype == ref[0].dtype == torch.float32, where
        assert got[1].dtype == ref[1].dtype == x_dtype, where
        for mine, peft in zip(got, ref, strict=True):
            tol = 1e-2 if mine.dtype == torch.bfloat16 else 1e-5  # bf16 grads: one rounding
            # Relative to the tensor's scale: A's gradient sums 1024 outputs x 10 tokens, and
            # the two sides sum in another order (CPUs block the matmuls differently: on an
            # AMD EPYC it differs by 2.2e-5 in entries of up to 23.6)
            scale = max(1.0, peft.abs().max().item())
            torch.testing.assert_close(
                mine, peft, atol=tol * scale, rtol=tol, msg=lambda m, w=where: f"{w}: {m}"
            )


def test_the_fused_layer_steps_aside_where_peft_does_more(tiny_model):
    engine = _engine(tiny_model, "float32")
    layer = engine.model.get_output_embeddings()
    assert fused_lora._plan(layer) is not None
    layer.lora_dropout["student"] = torch.nn.Dropout(0.1).eval()
    assert fused_lora._plan(layer) is not None  # eval mode: dropout passes x through
    layer.lora_dropout["student"].train()
    assert fused_lora._plan(layer) is None  # dropout that drops: peft's path
    layer.lora_dropout["student"] = torch.nn.Identity()
    layer.base_layer.weight.requires_grad_(True)
    assert fused_lora._plan(layer) is None  # a trained base weight: peft's autograd
    layer.base_layer.weight.requires_grad_(False)
    engine._adapter_layers(on=False)
    assert fused_lora._plan(layer) is None  # adapters off: the base layer alone
    engine._adapter_layers(on=True)
    engine.create_adapter("teacher", rank=4, seed=1)
    layer.set_adapter(["student", "teacher"])
    assert fused_lora._plan(layer) is None  # two adapters at once
    # An adapter added later is re-classed too (install is idempotent: nothing left to do).
    assert fused_lora.install(engine.peft) == 0

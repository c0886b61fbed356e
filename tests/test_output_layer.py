"""The output layer with its LoRA as one product (``output_layer.fused``) against peft's own
forward and backward, in float32 and bf16, and the cases where it must step aside."""

from __future__ import annotations

import pytest
import torch

from rlcli.server import output_layer
from rlcli.server.engine import Engine


def _engine(model, dtype: str) -> Engine:
    engine = Engine(str(model), device="cpu", dtype=dtype, grad_checkpointing=False)
    engine.create_adapter("student", rank=4, seed=0, alpha=6.0)  # scaling 1.5: not 1
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at 0: make the LoRA term count
        for p in engine.adapters["student"].params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    engine._set_adapter("student")
    return engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_output_layer_gives_pefts_logits_and_gradients(tiny_model, dtype):
    engine = _engine(tiny_model, dtype)
    layer = engine.model.get_output_embeddings()
    assert layer.scaling["student"] == 1.5
    fused = output_layer.fused(layer)
    assert fused is not None
    a, b = layer.lora_A["student"].weight, layer.lora_B["student"].weight
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(7, layer.in_features, generator=gen)
    g = torch.randn(7, layer.out_features, generator=gen)

    def run(head):
        x = hidden.clone().requires_grad_()
        logits = head(x)
        return (logits.detach(), *torch.autograd.grad((logits * g).sum(), (x, a, b)))

    got, ref = run(fused), run(layer)
    assert got[0].dtype == ref[0].dtype == torch.float32
    for mine, peft in zip(got, ref, strict=True):
        torch.testing.assert_close(mine, peft, atol=1e-5, rtol=1e-4)


def test_the_fused_output_layer_steps_aside_where_peft_does_more(tiny_model):
    engine = _engine(tiny_model, "float32")
    layer = engine.model.get_output_embeddings()
    assert output_layer.fused(layer) is not None
    layer.lora_dropout["student"] = torch.nn.Dropout(0.1)
    assert output_layer.fused(layer) is None  # dropout: peft's path
    layer.lora_dropout["student"] = torch.nn.Identity()
    engine._adapter_layers(on=False)
    assert output_layer.fused(layer) is None  # adapters off: the base layer alone
    engine._adapter_layers(on=True)
    engine.create_adapter("teacher", rank=4, seed=1)
    layer.set_adapter(["student", "teacher"])
    assert output_layer.fused(layer) is None  # two adapters at once
    assert output_layer.fused(engine.model.model.layers[0].self_attn.q_proj.base_layer) is None

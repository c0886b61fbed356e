"""Grouped-query attention on a CPU without copying the keys and values.

transformers' ``sdpa`` attention repeats each key/value head once per query head of its group
(a full copy of the KV cache, every layer, every decode step) whenever it passes an attention
mask, because on CUDA a mask sends ``enable_gqa`` to the slow math kernel. The engine passes a
mask whenever rows are padded (prompts of different lengths), which is most RL batches. On a
CPU the flash kernel takes the mask and the grouped heads as they are: at batch 16 and a
430-token cache on SmolLM2 one layer's attention takes 0.53 ms instead of 2.5 ms, and a
padded decode step ~50 ms less (``docs/server-engine.md``, "Sampling").

``use_grouped_sdpa`` registers this as an attention implementation through transformers'
documented ``AttentionInterface`` (masks built exactly as for ``sdpa``) and switches a CPU
model that runs ``sdpa`` to it. Anything else (another device, no mask, no grouping) goes to
transformers' own function unchanged.

Both paths run inside ``activations.exact()``: in a bf16 CPU engine's training forward,
attention keeps its float32 inputs for the backward (``activations.py`` says why).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from rlcli.server.engine import activations

log = logging.getLogger(__name__)

NAME = "rlcli_grouped_sdpa"


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1
    with activations.exact():  # queries and keys stay float32 for the backward
        if attention_mask is None or not grouped or query.device.type != "cpu":
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                **kwargs,
            )  # fmt: skip
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            enable_gqa=True,
        )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: torch.nn.Module) -> bool:
    """Switch a CPU model running ``sdpa`` to ``grouped_sdpa_forward``; whether it did."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if not hasattr(model, "set_attn_implementation"):  # transformers before 4.56's API
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, grouped_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError) as e:  # a model that refuses custom attention
        log.warning("keeping sdpa attention (%s)", e)
        return False
    return True

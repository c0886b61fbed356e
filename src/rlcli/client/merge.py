"""An adapter merged into its base model (``rlcli export --merge``, and before ``--gguf``): the
base model + the PEFT adapter, ``merge_and_unload``, saved with the tokenizer as a transformers
model folder (``AutoModelForCausalLM.from_pretrained`` loads it, and so does vLLM).

Merged in float32; a tied output layer is untied first when the adapter trains it, so the merged
model embeds tokens as the trained model did.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlcli.client.checkpoint_fetch import Say
from rlcli.errors import RlcliError


def merge(adapter: Path, base_model: str, out: Path, say: Say, as_saved: bool = True) -> None:
    """Base model + adapter, merged, saved with the tokenizer as a transformers folder.

    Merged in float32 (exact sums), then cast back to the base model's saved dtype, read from
    its config before loading (loading in float32 makes the loaded config say float32), unless
    ``as_saved`` is False (the GGUF export rounds once, to its own type)."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    say(f"loading the base model {base_model} ...")
    try:
        config = AutoConfig.from_pretrained(base_model)
        saved_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved_dtype, str):
            saved_dtype = getattr(torch, saved_dtype, None)
        model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(base_model)
    except (OSError, ValueError) as e:
        raise RlcliError(
            f"cannot load the base model {base_model} here ({type(e).__name__}); pass "
            "--base-model with a local copy or its hub id"
        ) from None
    say("merging the adapter ...")
    if _adapts_output_layer(adapter):
        _untie_output_layer(model)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    if as_saved and isinstance(saved_dtype, torch.dtype) and saved_dtype != torch.float32:
        merged = merged.to(saved_dtype)
        merged.config.dtype = saved_dtype
    merged.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _adapts_output_layer(adapter: Path) -> bool:
    """Whether the adapter's LoRA targets the output layer (``lm_head``: the cookbook's
    ``train_unembed`` default), from its ``adapter_config.json``."""
    try:
        targets = json.loads((adapter / "adapter_config.json").read_text()).get("target_modules")
    except (OSError, ValueError):
        return False
    if isinstance(targets, str):  # a regular expression over module names
        return "lm_head" in targets
    return "lm_head" in (targets or [])


def _untie_output_layer(model) -> bool:
    """Give a tied output layer its own weight (and the config ``tie_word_embeddings=False``).

    Why: with tied embeddings (SmolLM2, Qwen's small models) the output layer and the input
    embedding are one matrix, and peft merges the output layer's LoRA into it: the merged
    model would then embed tokens with the output layer's update too, which the trained model
    never did. Untied, the merge changes the output layer alone. Returns whether it untied."""
    import torch

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    text_config = getattr(model.config, "get_text_config", lambda: None)()
    if text_config is not None:
        text_config.tie_word_embeddings = False
    return True

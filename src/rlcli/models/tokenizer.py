"""Loading a tokenizer cheaply, and tokenizer repairs: GGUF byte-level BPE saved under the plain
class, the chat template's end of turn, and special tokens made to agree with the model config."""

from __future__ import annotations

import json
from pathlib import Path

# The classes ``AutoTokenizer`` resolves to the tokenizers-backed base class itself (transformers
# 5: ``TokenizersBackend``; 4: ``PreTrainedTokenizerFast``, an alias of it in 5).
_PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def plain_tokenizer_folder(name: str) -> bool:
    """``name`` is a local folder whose tokenizer ``AutoTokenizer`` would load as the plain
    tokenizers-backed class (a ``tokenizer.json``, that class named, no custom code)."""
    folder = Path(name)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        (folder / "tokenizer.json").is_file()
        and config.get("tokenizer_class") in _PLAIN_CLASSES
        and "auto_map" not in config
    )


def load_tokenizer(name: str):
    """``AutoTokenizer.from_pretrained(name)``, without importing ``AutoTokenizer`` where the
    answer is known: for a plain tokenizer folder (every model rlcli converts or builds) the
    class is loaded directly. ``AutoTokenizer``'s module imports transformers' model registry
    (~2 CPU s a process); a recipe child, the server's HTTP process and each CLI command that
    tokenizes would pay it for nothing."""
    if plain_tokenizer_folder(name):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def byte_level_as_plain(tokenizer):
    """transformers (5.5) converts a GGUF byte-level BPE tokenizer (SmolLM2's ``gpt2``) into a
    ``CodeLlamaTokenizer``; saved under that class and loaded again, its pre-tokenizer becomes
    Metaspace and every space encodes as ``<|endoftext|>``. The converted pipeline itself is
    right, so it is saved under the plain tokenizers-backed class instead."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if type(tokenizer).__name__ != "CodeLlamaTokenizer" or not isinstance(
        getattr(backend, "pre_tokenizer", None), pre_tokenizers.ByteLevel
    ):
        return tokenizer
    plain = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        unk_token=tokenizer.unk_token,
        pad_token=tokenizer.pad_token,
    )
    plain.chat_template = tokenizer.chat_template
    return plain


def end_of_turn_id(tokenizer) -> int | None:
    """The token the chat template puts right after an assistant message's text (ChatML's
    ``<|im_end|>``), or None when there is no template or it ends turns with plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "rlcli-end-of-turn-probe"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
            tokenize=False,
        )
    except Exception:  # a template that needs other roles or fields: no answer
        return None
    after = text[text.rfind(marker) + len(marker) :] if marker in text else ""
    special = set(tokenizer.all_special_tokens) | {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special
    }
    first = next(
        (tok for tok in sorted(special, key=len, reverse=True) if after.startswith(tok)), None
    )
    return tokenizer.convert_tokens_to_ids(first) if first else None


def agree_special_tokens(tokenizer, config, generation_config) -> None:
    """Make the tokenizer's eos/bos/pad, the generation config's eos and the chat template's
    end of turn name the same tokens, in place.

    transformers' GGUF tokenizer conversion (5.5) names ``<|im_start|>`` as eos for SmolLM2
    while the GGUF metadata (which became ``config``) says ``<|im_end|>``; every tool reading
    the tokenizer then stops at the wrong token. The GGUF's ids win; the template's end of
    turn is added to the generation config's eos when it is another token."""
    for attr, token_id in (
        ("eos_token", config.eos_token_id),
        ("bos_token", config.bos_token_id),
        ("pad_token", config.pad_token_id),
    ):
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))
    eos = config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    turn_end = end_of_turn_id(tokenizer)
    if turn_end is not None and turn_end not in eos_ids:
        eos_ids.append(turn_end)
    if eos_ids:
        generation_config.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids

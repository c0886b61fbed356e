"""Resolving base models, and the tiny offline test model.

A base model is a hub id (``Qwen/Qwen3-4B-Instruct-2507``), a local folder written by
``save_pretrained``, or a ``.gguf`` file, which is converted once into a cached folder under
``$RLCLI_HOME/models/`` (named by the file's content hash) that every part of the stack then
loads as a folder. The tiny model is a real Qwen3-architecture checkpoint of a few hundred
thousand parameters with a byte-level BPE tokenizer trained here, so that tests, demos and
smoke tests run on any machine without touching the model hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from functools import cache
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def is_local_model(name: str) -> bool:
    """A local folder holding a ``config.json`` (as ``save_pretrained`` writes it)."""
    return (Path(name).expanduser() / "config.json").is_file()


def is_gguf_file(name: str) -> bool:
    """A path to an existing file whose name ends in ``.gguf``."""
    path = Path(name).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


def resolve_model_name(name: str) -> str:
    """Absolute path for local folders (so every process agrees on it); for a ``.gguf`` file,
    the folder it converts to (without converting: see ``local_model``); hub ids unchanged."""
    if is_gguf_file(name):
        return str(gguf_folder(name))
    if is_local_model(name):
        return str(Path(name).expanduser().resolve())
    return name


def local_model(name: str, report=None) -> str:
    """``resolve_model_name``, converting a ``.gguf`` file into its cached folder first when
    that folder is not there yet (``report`` hears about the conversion)."""
    if is_gguf_file(name):
        return str(convert_gguf_cached(name, report))
    return resolve_model_name(name)


@cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# Bumped whenever the conversion's output changes, so folders an older rlcli converted (for
# example before byte-level BPE tokenizers were saved under the plain class) are not reused.
GGUF_CONVERSION = 2


def gguf_folder(gguf_file: str | os.PathLike[str]) -> Path:
    """``$RLCLI_HOME/models/<file stem>-<hash of content and conversion>``: the same file gives
    the same folder wherever it lies, and a changed file (or converter) a new one."""
    from rlcli.home import rlcli_home

    source = Path(gguf_file).expanduser().resolve()
    stat = source.stat()
    content = _sha256(str(source), stat.st_size, stat.st_mtime_ns)
    digest = hashlib.sha256(f"{content}/conversion-{GGUF_CONVERSION}".encode()).hexdigest()
    return rlcli_home() / "models" / f"{source.stem}-{digest[:16]}"


def convert_gguf_cached(gguf_file: str | os.PathLike[str], report=None) -> Path:
    """The converted folder of ``gguf_file``, converting it first if needed. The conversion
    writes a temporary folder and renames it into place, so a killed conversion never leaves a
    half-written model where the next run would load it."""
    from rlcli.errors import RlcliError

    source = Path(gguf_file).expanduser().resolve()
    if not source.is_file():
        raise RlcliError(f"{gguf_file}: no such GGUF file")
    target = gguf_folder(source)
    if is_local_model(str(target)):
        return target
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise RlcliError(
            f"{gguf_file}: reading a .gguf needs the gguf package: pip install 'rlcli[gguf]'"
        ) from None
    if report:
        report(f"converting {source.name} into {target} (once; later runs reuse it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        import_gguf(source, tmp)
        (tmp / "rlcli_gguf.json").write_text(
            json.dumps({"source": str(source), "conversion": GGUF_CONVERSION}) + "\n"
        )
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished the same conversion first
            if not is_local_model(str(target)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
) -> Path:
    """Write a tiny Qwen3 model and its tokenizer to ``path`` and return the path.

    The tokenizer is byte-level BPE trained on a generated corpus, with ChatML special tokens
    and chat template (eos ``<|im_end|>``); the model's ``vocab_size`` equals the tokenizer's.
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
    tokenizer.chat_template = CHATML_TEMPLATE
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


def import_gguf(gguf_file: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Convert a GGUF checkpoint (dequantized to float32) into a ``save_pretrained`` folder,
    which every part of the stack loads: the server, the SDK's tokenizer, the cookbook."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(gguf_file).expanduser().resolve()
    if not source.is_file():
        from rlcli.errors import RlcliError

        raise RlcliError(f"{gguf_file}: no such GGUF file")
    target = Path(out).expanduser().resolve()
    tokenizer = byte_level_as_plain(
        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    )
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, config=gguf_config(source)
    )
    agree_special_tokens(tokenizer, model.config, model.generation_config)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(target)
    model.save_pretrained(target)
    return target


def gguf_config(source: Path):
    """transformers' config of a GGUF file, with ``head_dim`` from the file's
    ``attention.key_length``: transformers (5.5) leaves Qwen3's at its default of 128, so a
    model whose heads are another size (``hidden / heads``, the tiny model's 16) would not
    load."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.attention.key_length")
    if field is not None and hasattr(config, "head_dim"):
        config.head_dim = int(field.contents())
    return config


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

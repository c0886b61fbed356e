"""Doc-to-LoRA: the hypernetwork module, its routes on a real server (tiny model), `rlcli train
d2l` end to end (run, resume, cancel's checkpoint path, dry run), `rlcli hypernet internalize`,
sampling the adapter through the SDK, and the refusals."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import cli
from rlcli.data.d2l_examples import (
    answer_choices,
    read_examples,
    split_count,
    synthetic_facts,
    synthetic_haystacks,
)
from rlcli.server.engine.hypernet import (
    Hypernet,
    HypernetConfig,
    lora_delta,
    merge_chunks,
    merge_documents,
)

DEAD_URL = "http://127.0.0.1:9"
SMALL = {"rank": 4, "latent": 16, "chunk_tokens": 32, "max_chunks": 2}


def small_net(**over) -> Hypernet:
    config = HypernetConfig(
        base_model="m", n_layers=3, first_layer=0, hidden=24, d_in=40, **{**SMALL, **over}
    )
    torch.manual_seed(0)
    return Hypernet(config)


def test_a_fresh_hypernet_writes_a_zero_update_and_chunks_add_up():
    net = small_net()
    features, mask = torch.randn(2, 3, 7, 24), torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # padding is ignored, not attended to
    a, b = net(features, mask)
    assert a.shape == (2, 3, 4, 40) and b.shape == (2, 3, 4, 24)
    assert a.abs().sum() > 0 and b.abs().sum() == 0  # B scaled from zero: a no-op adapter
    with torch.no_grad():
        net.scale_b.fill_(1.0)
        a, b = net(features, mask)
        net.bias_b.normal_()  # a trained-like bias LoRA
    # two chunks of one document -> rank 12: their two blocks, then the bias block once
    merged_a, merged_b = merge_chunks(a, b, net.bias())
    assert merged_a.shape == (3, 12, 40) and merged_b.shape == (3, 12, 24)
    x = torch.randn(1, 5, 40)
    layer = 1
    apart = sum(lora_delta(x, a[c : c + 1, layer], b[c : c + 1, layer], 2.0) for c in range(2))
    apart = apart + lora_delta(x, net.bias_a[layer][None], net.bias_b[layer][None], 2.0)
    together = lora_delta(x, merged_a[layer][None], merged_b[layer][None], 2.0)
    torch.testing.assert_close(together, apart)


def test_a_hypernet_saved_in_the_old_layout_keeps_its_bias_in_every_chunk():
    """Saved before the bias LoRA went once per document, a config has no bias_per_chunk;
    it loads in that layout, so its adapters are the ones it was trained to make."""
    saved = small_net().config.to_dict()
    assert HypernetConfig.from_dict(saved).bias_per_chunk is False
    del saved["bias_per_chunk"]
    old = Hypernet(HypernetConfig.from_dict(saved))
    assert old.config.bias_per_chunk and old.bias() is None
    new = Hypernet(HypernetConfig.from_dict({**saved, "bias_per_chunk": False}))
    features, mask = torch.randn(2, 3, 7, 24), torch.ones(2, 7, dtype=torch.long)
    with torch.no_grad():
        old.scale_b.fill_(1.0)
        old.bias_b.normal_()
        new.load_state_dict(old.state_dict())
        a, b = old(features, mask)
        new_a, new_b = new(features, mask)
    torch.testing.assert_close(a, new_a + old.bias_a)  # the bias in each chunk's rows
    torch.testing.assert_close(b, new_b + old.bias_b)
    assert merge_chunks(a, b, old.bias())[0].shape == (3, 8, 40)  # no separate bias block


def test_documents_merge_apart():
    net = small_net()
    features, mask = torch.randn(3, 3, 7, 24), torch.ones(3, 7, dtype=torch.long)
    with torch.no_grad():
        net.scale_b.fill_(1.0)
        a, b = net(features, mask)
    merged_a, merged_b = merge_documents(a, b, owners=[0, 1, 0])  # chunks 0 and 2: document 0
    assert merged_a.shape == (2, 3, 8, 40) and merged_b.shape == (2, 3, 8, 24)
    torch.testing.assert_close(merged_a[0], merge_chunks(a[[0, 2]], b[[0, 2]])[0])
    torch.testing.assert_close(merged_b[1, :, :4], b[1])
    assert merged_a[1, :, 4:].abs().sum() == 0 == merged_b[1, :, 4:].abs().sum()  # padding


def test_a_training_split_cuts_equal_pieces_within_the_limits():
    """``split_ids``: the reference's equal parts, never below MIN_SPLIT_TOKENS, never more
    than max_chunks, never fewer than chunk_tokens needs; the pieces are the document."""
    from rlcli.server.engine.d2l import MIN_SPLIT_TOKENS, split_ids

    config = HypernetConfig(
        base_model="m", n_layers=1, first_layer=0, hidden=4, d_in=4, chunk_tokens=64,
        max_chunks=6,
    )  # fmt: skip
    ids = list(range(100))
    pieces = split_ids(ids, 4, config)
    assert [len(p) for p in pieces] == [25, 25, 25, 25] and sum(pieces, []) == ids
    assert len(split_ids(ids, 8, config)) == 100 // MIN_SPLIT_TOKENS  # none under 25 tokens
    assert split_ids(ids[:40], 3, config) == [ids[:40]]  # too short to cut in two
    assert len(split_ids(list(range(64 * 6)), 2, config)) == 6  # as chunk_tokens needs
    assert len(split_ids(list(range(300)), 64, config)) == 6  # at most max_chunks
    rng = random.Random(0)
    counts = [split_count(rng, 8) for _ in range(2000)]
    assert 0.45 < counts.count(1) / 2000 < 0.55 and set(counts) == set(range(1, 9))
    assert {split_count(rng, 1) for _ in range(20)} == {1}


def full_forward_adapter(engine, net, chunks: list[list[int]]):
    """The reference: what internalizing computed before it ran chunks by length. Every chunk
    padded to the longest in one batch, the whole model (output layer and logits too), the
    adapted layers' ``hidden_states`` stacked -> (A, B with the scale folded in) per layer."""
    width = max(len(c) for c in chunks)
    ids = torch.full((len(chunks), width), engine.pad_id, dtype=torch.long)
    mask = torch.zeros((len(chunks), width), dtype=torch.long)
    for i, chunk in enumerate(chunks):
        ids[i, : len(chunk)] = torch.tensor(chunk)
        mask[i, : len(chunk)] = 1
    with torch.no_grad():
        out = engine.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        assert out.logits.shape[:2] == ids.shape
        features = torch.stack(out.hidden_states[1 + net.config.first_layer :], dim=1).float()
        a, b = merge_chunks(*net(features, mask), net.bias())
    return a, b * net.scaling


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_internalizing_by_chunk_length_gives_the_full_forwards_adapter(tiny_model, dtype):
    """generate() runs only the decoder, chunks of one length together and unpadded; the
    adapter it writes equals the full padded forward's (float tolerance), every layer and
    the last layers only, in both engine dtypes."""
    from rlcli.server.engine.core import Engine

    engine = Engine(str(tiny_model), device="cpu", dtype=dtype)
    document = " ".join(f"Kalo{i} lives in city {i}." for i in range(4))
    for seed, lora_layers in ((0, 0), (1, 1)):
        hypernet_id = f"h{lora_layers}"
        settings = {**SMALL, "chunk_tokens": 16, "max_chunks": 8, "lora_layers": lora_layers}
        engine.hypernets.create(hypernet_id, settings, seed)
        net = engine.hypernets.training[hypernet_id].net
        with torch.no_grad():
            net.scale_b.fill_(1.0)  # a trained-like B: not the fresh no-op
        chunks = engine.hypernets._document_ids(document, net.config, "document")
        assert len(chunks) >= 3 and len(chunks[-1]) < 16  # full chunks and a shorter last one
        state, config, facts = engine.hypernets.generate(net, document)
        assert facts["chunks"] == len(chunks) and config.r == 4 * (len(chunks) + 1)  # + bias
        a, b = full_forward_adapter(engine, net, chunks)
        first = net.config.first_layer
        assert len(state) == 2 * net.config.n_layers == 2 * (2 - first)
        assert b.abs().max() > 0
        for i in range(net.config.n_layers):
            prefix = f"base_model.model.model.layers.{first + i}.mlp.down_proj"
            torch.testing.assert_close(state[f"{prefix}.lora_A.weight"], a[i])
            torch.testing.assert_close(state[f"{prefix}.lora_B.weight"], b[i].T)


def test_a_step_whose_chunks_would_not_fit_the_memory_stated_is_refused(tiny_model, monkeypatch):
    from rlcli.server.engine import d2l
    from rlcli.server.engine.core import Engine
    from rlcli.server.errors import UserError

    engine = Engine(str(tiny_model), device="cpu", dtype="float32")
    engine.hypernets.create("h", {**SMALL, "chunk_tokens": 16, "max_chunks": 8}, 0)
    example = {"document": "Kalo lives in city 4. " * 8, "question": "Where?", "answer": "4"}
    monkeypatch.setattr(d2l, "MAX_STEP_FEATURE_BYTES", 16 * 1024)
    with pytest.raises(UserError, match=r"examples: 2 documents of \d+ chunks in all; their hid"):
        engine.hypernets.step("h", [example] * 2, 1e-3, 0.0, train=True)
    assert engine.hypernets.training["h"].steps == 0


def test_a_step_reads_a_document_split_as_asked(tiny_model):
    from rlcli.server.engine.core import Engine

    engine = Engine(str(tiny_model), device="cpu", dtype="float32")
    engine.hypernets.create("h", {**SMALL, "chunk_tokens": 128, "max_chunks": 8}, 0)
    with torch.no_grad():
        engine.hypernets.training["h"].net.scale_b.fill_(1.0)  # a trained-like B
    document = " ".join(f"Kalo{i} lives in city {i}." for i in range(8))  # ~110 tokens
    example = {"document": document, "question": "Where does Kalo3 live?", "answer": "city 3"}
    whole = engine.hypernets.step("h", [example], 1e-3, 0.0, train=False)
    split = engine.hypernets.step("h", [dict(example, chunks=4)], 1e-3, 0.0, train=False)
    assert whole["chunks"] == 1 and split["chunks"] == 4
    assert abs(whole["loss"] - split["loss"]) > 1e-3  # four LoRAs summed, not one


def test_a_step_backpropagates_only_through_the_adapted_layers(tiny_model):
    """With the last layer adapted, the backward pass stops there: nothing reaches layer 0
    (the engine's model makes its input embeddings require grad, which once ran it through
    every layer), and nothing of the layers below is kept after the step."""
    from rlcli.server.engine.core import Engine

    engine = Engine(str(tiny_model), device="cpu", dtype="float32")
    engine.hypernets.create("h", {**SMALL, "lora_layers": 1}, 0)
    reached = []
    layers = engine.hypernets._layers()
    hooks = [layer.register_full_backward_hook(lambda *_, i=i: reached.append(i))
             for i, layer in enumerate(layers)]  # fmt: skip
    import weakref

    embedded = []  # the question's embeddings: nothing may keep them once the step is done
    hooks.append(engine.model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: embedded.append(weakref.ref(output))))  # fmt: skip
    example = {"document": "Kalo plays the harp.", "question": "What?", "answer": "harp"}
    out = engine.hypernets.step("h", [example], 1e-3, 0.0, train=True)
    for h in hooks:
        h.remove()
    assert out["grad_norm"] > 0 and set(reached) == {len(layers) - 1}
    # no graph left alive below the adapted layers (cutting it at the first adapted layer
    # did: SmolLM2 grew 0.3 GB a step)
    assert embedded and all(ref() is None for ref in embedded)


def test_examples_are_read_by_line_and_synthetic_facts_are_seeded():
    rows = read_examples(
        ['{"document": "d", "question": "q", "answer": "a"}',
         '{"document": "e", "qa": [{"question": "q1", "answer": "a1"}, '
         '{"question": "q2", "answer": "a2"}]}'],
        "x.jsonl",
    )  # fmt: skip
    assert [r["question"] for r in rows] == ["q", "q1", "q2"]
    with pytest.raises(Exception, match=r"line 2: .*document") as bad:
        read_examples(['{"document": "d", "question": "q", "answer": "a"}', '{"question": 1}'],
                      "bad.jsonl")  # fmt: skip
    assert "bad.jsonl" in str(bad.value)
    written = read_examples(['{"document": "Orla Finch lives in Lisbon. It rained."}'], "d.jsonl")
    assert {"question": "Fill in the blank: Orla Finch lives in ___.", "answer": "Lisbon"} in [
        {k: r[k] for k in ("question", "answer")} for r in written
    ]  # a document only: questions written as internalize's templates write them
    with pytest.raises(Exception, match=r"line 1: a document only, and no sentence"):
        read_examples(['{"document": "it rained."}'], "d.jsonl")
    stacks = synthetic_haystacks(12, seed=1, most=6)
    assert stacks == synthetic_haystacks(12, seed=1, most=6)
    assert len({len(r["document"].split(". ")) for r in stacks}) > 2  # 0..6 fillers each
    facts = synthetic_facts(5, seed=3, filler=2)
    assert facts == synthetic_facts(5, seed=3, filler=2) != synthetic_facts(5, seed=4)
    for row in facts:
        assert row["answer"] in answer_choices(row["question"]) and row["answer"] in row["document"]


@pytest.fixture(scope="module")
def hypernets(server):
    from rlcli.client.d2l import Hypernets

    return Hypernets(server.base_url)


@pytest.fixture(scope="module")
def fresh(hypernets):
    """A saved hypernetwork that never trained (its adapters are no-ops)."""
    made = hypernets.create(seed=0, **SMALL)
    path = hypernets.save(made["hypernet_id"], "fresh")["path"]
    hypernets.remove(made["hypernet_id"])
    return path


def prompt_tokens(tiny_model, question: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_fresh_hypernets_adapter_leaves_logprobs_unchanged_and_a_key_is_deterministic(
    hypernets, fresh, service, tiny_model
):
    import tinker

    made = hypernets.internalize(fresh, "Kalo's favorite color is red.", session_key="k")
    assert made["path"].startswith("tinker://") and "/sampler_weights/" in made["path"]
    assert made["chunks"] == 1 and made["rank"] == 8 and not made["reused"]
    again = hypernets.internalize(fresh, "another text, same key", session_key="k")
    assert again["path"] == made["path"] and again["reused"]  # not recomputed
    other = hypernets.internalize(fresh, "Kalo's favorite color is red.", session_key="k2")
    assert other["path"] != made["path"]
    prompt = tinker.ModelInput.from_ints(prompt_tokens(tiny_model, "What color?"))
    base = service.create_sampling_client(base_model=str(tiny_model)).result()
    adapted = service.create_sampling_client(model_path=made["path"]).result()
    assert adapted.compute_logprobs(prompt).result() == base.compute_logprobs(prompt).result()
    params = tinker.SamplingParams(max_tokens=4, temperature=0.0)
    out = adapted.sample(prompt, num_samples=1, sampling_params=params).result()
    assert len(out.sequences[0].tokens) >= 1


def test_a_hypernet_of_the_last_layers_trains_and_its_adapter_samples(
    hypernets, service, tiny_model
):
    """--lora-layers 1: the LoRA on the last layer only (cheaper training: the backward pass
    stops below it); its adapter names that layer and samples like any other."""
    import tinker

    made = hypernets.create(seed=1, lora_layers=1, **SMALL)
    assert made["n_layers"] == 1 and made["first_layer"] == 1
    example = {"document": "Kalo plays the harp.", "question": "What?", "answer": "harp"}
    first = hypernets.step(made["hypernet_id"], [example] * 2, 1e-2)
    assert first["steps"] == 1 and first["grad_norm"] > 0
    adapter = hypernets.internalize(made["hypernet_id"], "Kalo plays the harp.")
    hypernets.remove(made["hypernet_id"])
    prompt = tinker.ModelInput.from_ints(prompt_tokens(tiny_model, "What?"))
    client = service.create_sampling_client(model_path=adapter["path"]).result()
    assert len(client.compute_logprobs(prompt).result()) == prompt.length


def test_a_document_of_several_chunks_trains_as_it_is_internalized(hypernets, service, tiny_model):
    """A training step takes a document of two chunks beside one of one; its answer loss is
    the one the document's internalized adapter gives through the Tinker API (the chunks'
    LoRAs summed both ways), and not the base model's."""
    import tinker
    from transformers import AutoTokenizer

    from rlcli.models.tokenizer import end_of_turn_id

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    document = " ".join(f"Kalo{i} lives in city {i}." for i in range(4))
    assert 32 < len(tok(document, add_special_tokens=False)["input_ids"]) <= 64  # 2 chunks
    example = {"document": document, "question": "Where does Kalo3 live?", "answer": "city 3"}
    short = {"document": "Kalo plays the harp.", "question": "What?", "answer": "harp"}
    made = hypernets.create(seed=2, **SMALL)
    hid = made["hypernet_id"]
    trained = hypernets.step(hid, [example, short], 5e-2)
    assert trained["steps"] == 1 and trained["grad_norm"] > 0
    loss = hypernets.step(hid, [example], 1e-9, train=False)["loss"]
    split = hypernets.step(hid, [dict(example, chunks=2)], 1e-9, train=False)  # 28 + 27 tokens
    adapter = hypernets.internalize(hid, document)
    hypernets.remove(hid)
    assert adapter["chunks"] == 2 and adapter["rank"] == 3 * SMALL["rank"]  # 2 chunks, bias
    prompt = prompt_tokens(tiny_model, example["question"])
    ids = prompt + tok(example["answer"], add_special_tokens=False)["input_ids"]
    ids.append(end_of_turn_id(tok))

    def answer_nll(client) -> float:
        logprobs = client.compute_logprobs(tinker.ModelInput.from_ints(ids)).result()
        return -sum(logprobs[len(prompt) :]) / (len(ids) - len(prompt))

    adapted = answer_nll(service.create_sampling_client(model_path=adapter["path"]).result())
    base = answer_nll(service.create_sampling_client(base_model=str(tiny_model)).result())
    assert adapted == pytest.approx(loss, abs=1e-3)
    assert abs(adapted - base) > 1e-3
    # "chunks" reads the 55 tokens as two equal pieces, not 32 + 23: another adapter (the
    # engine test below sees how far apart; here the route passes it, on a deterministic CPU)
    assert split["chunks"] == 2 and split["loss"] != loss


@pytest.mark.slow
def test_a_short_training_answers_held_out_documents_and_another_documents_adapter_does_not(
    tmp_path, server, service, hypernets, tiny_model
):
    """The learning test, on the tiny model: SmolLM2's hypernetwork starts reading after
    400-700 steps, 7-12 minutes on these cores (docs/d2l.md; its receipts are in benchmarks/).
    `rlcli train d2l` on 6,400 one-fact documents (400 steps, ~25 s), then 32 held-out
    documents (facts never trained on) internalized: greedy answers through the SDK are right
    well above chance with the document's own adapter, at chance with another document's, and
    never from the base model; the answer's loss is lower with the right adapter too."""
    import tinker
    from transformers import AutoTokenizer

    result = cli(
        "train", "d2l", "--model", str(tiny_model), "--base-url", server.base_url,
        "--dataset", "synthetic:6400", "--batch-size", "16", "--lr", "1e-2", "--seed", "0",
        "--save-every", "0", "--log-path", str(tmp_path / "run"), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    path = json.loads(result.stdout)["hypernet_path"]
    seen = {(r["question"], r["answer"]) for r in synthetic_facts(6400, seed=0)}
    held = [r for r in synthetic_facts(200, seed=12345) if (r["question"], r["answer"]) not in seen]
    held = held[:32]
    adapters = [hypernets.internalize(path, r["document"])["path"] for r in held]
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    params = tinker.SamplingParams(max_tokens=4, temperature=0.0)
    base = service.create_sampling_client(base_model=str(tiny_model)).result()

    def right(client, row) -> bool:
        prompt = tinker.ModelInput.from_ints(prompt_tokens(tiny_model, row["question"]))
        out = client.sample(prompt, num_samples=1, sampling_params=params).result()
        reply = tok.decode(out.sequences[0].tokens, skip_special_tokens=True)
        return reply.strip().lower().startswith(row["answer"].lower())

    own = other = from_base = 0
    for i, row in enumerate(held):
        own += right(service.create_sampling_client(model_path=adapters[i]).result(), row)
        control = adapters[(i + 1) % len(held)]
        other += right(service.create_sampling_client(model_path=control).result(), row)
        from_base += right(base, row)
    assert own >= 8 and own >= other + 6 and from_base == 0, (own, other, from_base)
    shuffled = [dict(r, document=held[(i + 1) % len(held)]["document"]) for i, r in
                enumerate(held)]  # fmt: skip
    loaded = hypernets.load(path)["hypernet_id"]
    loss_right = hypernets.step(loaded, held, 1e-9, train=False)["loss"]
    loss_other = hypernets.step(loaded, shuffled, 1e-9, train=False)["loss"]
    hypernets.remove(loaded)
    assert loss_right < loss_other - 0.1, (loss_right, loss_other)


def test_refusals_name_the_field(hypernets, fresh, server, service):
    from rlcli.errors import RlcliError

    doc = "Kalo's favorite color is red."
    with pytest.raises(RlcliError, match="document: the document has no tokens"):
        hypernets.internalize(fresh, "")
    with pytest.raises(RlcliError, match=r"document: the document has \d+ tokens.*at most 2"):
        hypernets.internalize(fresh, "word " * 200)
    with pytest.raises(RlcliError, match="no hypernetwork checkpoint at"):
        hypernets.internalize("tinker://hn-nope/hypernet_weights/x", doc)
    adapter = hypernets.internalize(fresh, doc)["path"]
    with pytest.raises(RlcliError, match="a sampler_weights checkpoint .a LoRA adapter., not"):
        hypernets.internalize(adapter, doc)
    with pytest.raises(RlcliError, match="unknown hypernet_id 'hn-unknown'"):
        hypernets.step("hn-unknown", [{"document": doc, "question": "q", "answer": "a"}], 1e-3)
    with pytest.raises(RlcliError, match="base_model: 'other/model' is not served here"):
        hypernets.create("other/model")
    with pytest.raises(Exception, match="hypernet_weights"):  # a hypernetwork is no sampler
        service.create_sampling_client(model_path=fresh).result()
    assert hypernets.server.caps["hypernetworks"]  # still serving


def test_a_hypernet_of_another_base_model_is_refused(hypernets, fresh, server_home):
    """The checkpoint's config names its base model; the engine compares it with its own."""
    import shutil

    from rlcli.errors import RlcliError
    from rlcli.server.store import checkpoints

    root = server_home / "checkpoints"
    run_id, _, name = fresh.removeprefix("tinker://").partition("/hypernet_weights/")
    version = checkpoints.resolve(root / run_id / "hypernet_weights" / name)
    staging = root / "hn-other" / "staged"
    staging.mkdir(parents=True)
    record = json.loads((version / "hypernet.json").read_text())
    record["config"]["base_model"] = "org/another-model"
    (staging / "hypernet.json").write_text(json.dumps(record))
    shutil.copy(version / "hypernet.safetensors", staging / "hypernet.safetensors")
    files = {f: staging / f for f in ("hypernet.json", "hypernet.safetensors")}
    checkpoints.write_files(root / "hn-other" / "hypernet_weights" / "x", files, {"x": 1})
    with pytest.raises(RlcliError, match="trained on org/another-model; this server's base model"):
        hypernets.internalize("tinker://hn-other/hypernet_weights/x", "Some text.")


def test_train_d2l_runs_resumes_and_its_hypernet_internalizes(tmp_path, server, tiny_model):
    run_dir = tmp_path / "run"
    args = (
        "train", "d2l", "--model", str(tiny_model), "--base-url", server.base_url,
        "--dataset", "synthetic:12", "--eval-dataset", "synthetic:4", "--batch-size", "4",
        "--latent", "16", "--chunk-tokens", "64", "--log-path", str(run_dir), "--json",
    )  # fmt: skip
    result = cli(*args, "--max-steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["hypernet_path"].endswith("/hypernet_weights/000002")
    assert summary["held_out_loss"] > 0 and "step 2/2" in result.stderr
    again = cli(*args, "--max-steps", "3")  # one more step, from the last checkpoint
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming in" in again.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["steps"] == 3
    path = json.loads(again.stdout)["hypernet_path"]
    assert path.split("/")[2] == summary["hypernet_path"].split("/")[2]  # the same id
    grown = cli("train", "d2l", "--model", str(tiny_model), "--base-url", server.base_url,
                "--dataset", "synthetic:4", "--batch-size", "4", "--init-checkpoint", path,
                "--filler", "12", "--split-chunks", "8",
                "--log-path", str(tmp_path / "grown"), "--json")  # fmt: skip
    assert grown.returncode == 0, grown.stderr[-3000:]
    assert json.loads(grown.stdout)["hypernet_path"].split("/")[2] != path.split("/")[2]
    first = json.loads((tmp_path / "grown" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["steps"] == 4  # the 3 steps it started from, then its own
    assert first["chunks"] > 4  # 4 documents, some read in pieces (--split-chunks)
    doc = tmp_path / "doc.txt"
    doc.write_text("Kalo's favorite color is red.")
    made = cli("hypernet", "internalize", str(doc), "--hypernet", path,
               "--base-url", server.base_url, "--session-key", "s", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    adapter = json.loads(made.stdout)["path"]
    sampled = cli("sample", "--checkpoint", adapter, "-p", "What is Kalo's favorite color?",
                  "--base-url", server.base_url, "--max-tokens", "3", "--json")  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    refused = cli("hypernet", "internalize", str(empty), "--hypernet", path,
                  "--base-url", server.base_url)  # fmt: skip
    assert refused.returncode == 1 and "the document is empty" in refused.stderr
    refused = cli("hypernet", "internalize", str(doc), "--hypernet", adapter,
                  "--base-url", server.base_url)  # fmt: skip
    assert refused.returncode == 1 and "a LoRA adapter" in refused.stderr


def test_split_chunks_draws_each_documents_pieces_from_the_steps_seed():
    from rlcli.recipes.d2l import Loop

    loop = Loop.__new__(Loop)  # batch() only: no server
    loop.examples = synthetic_facts(8, seed=3)
    loop.plan = {"batches_per_epoch": 2}
    loop.opts = {"batch_size": 4, "seed": 0, "split_chunks": 8}
    rows = loop.batch(1)
    assert rows == loop.batch(1) and all(1 <= r["chunks"] <= 8 for r in rows)  # a resume's
    loop.opts["split_chunks"] = 1
    assert all("chunks" not in r for r in loop.batch(1))  # as internalizing reads them
    loop.opts["filler_ramp"] = 0.5  # a curriculum: the first epoch in the documents' order
    assert loop.batch(0) + loop.batch(1) == loop.examples and loop.batch(2) != loop.examples[:4]
    ramped = synthetic_haystacks(400, seed=0, most=40, ramp=0.5)
    fillers = [r["document"].count(".") - 1 for r in ramped]  # sentences around the fact
    assert max(fillers[:20]) <= 4 and max(fillers[200:]) > 30  # growing, then up to 40


def test_dry_run_plans_and_a_bad_dataset_is_named(tmp_path, tiny_model):
    base = ("train", "d2l", "--model", str(tiny_model), "--base-url", DEAD_URL, "--dry-run")
    plan = cli(*base, "--dataset", "synthetic:20", "--batch-size", "8", "--json",
               "--log-path", str(tmp_path / "run"))  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    assert planned["examples"] == 20 and planned["steps"] == 2
    assert planned["options"]["lora_rank"] == 8 and not (tmp_path / "run").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"document": "d", "question": "q", "answer": "a"}\n{"document": ""}\n')
    refused = cli(*base, "--dataset", str(bad))
    assert refused.returncode == 1 and "line 2" in refused.stderr
    refused = cli(*base, "--dataset", "synthetic:zero")
    assert refused.returncode == 1 and "synthetic:N" in refused.stderr
    refused = cli(*base, "--dataset", "synthetic:20", "--init-checkpoint",
                  "tinker://r/sampler_weights/final")  # fmt: skip
    assert refused.returncode == 1
    assert "--init-checkpoint tinker://r/sampler_weights/final: a sampler_weights" in refused.stderr
    import rlcli  # the Python API: the same options, the same plan

    options = rlcli.D2LOptions(model=str(tiny_model), dataset="synthetic:20", base_url=DEAD_URL,
                               batch_size=4, dry_run=True)  # fmt: skip
    assert rlcli.train(options).plan.steps == 5


def test_runs_cancel_saves_the_hypernet_and_a_resume_continues(tmp_path, server, tiny_model):
    import os
    import subprocess

    from conftest import RLCLI, wait_for_steps

    run_dir = tmp_path / "run"
    args = (
        "train", "d2l", "--model", str(tiny_model), "--base-url", server.base_url,
        "--dataset", "synthetic:400", "--batch-size", "4", "--latent", "16",
        "--chunk-tokens", "64", "--save-every", "0", "--log-path", str(run_dir),
    )  # fmt: skip
    env = {"RLCLI_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([*RLCLI, *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    wait_for_steps(run_dir, 3, proc, timeout=300)  # loaded 2 cores: interpreter, imports, child
    cancelled = cli("runs", "cancel", str(run_dir), "--json", env=env)
    assert cancelled.returncode == 0, cancelled.stderr
    path = json.loads(cancelled.stdout)["checkpoint"]["state_path"]
    assert "/hypernet_weights/" in path
    proc.communicate(timeout=60)
    done = len(metrics.read_text().splitlines())
    last = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").open()][-1]
    assert last["cancelled"] and last["batch"] == done
    again = cli(*args, "--max-steps", str(done + 1), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.open()]
    assert steps == list(range(done + 1))  # picked up where it stopped

"""Sampling through the unmodified SDK: logprobs agree with forward passes, seeds reproduce,
stops are honoured, prompt logprobs have the documented shape, concurrent requests batch."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import tinker
from tinker import types


@pytest.fixture(scope="module")
def trained(service, tiny_model):
    """A training client moved off its initial weights, its tokenizer and a prompt."""
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=11
    ).result()
    tokenizer = trainer.get_tokenizer()
    text = "What is 3 + 4? The answer is 7."
    ids = tokenizer.encode(text)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("What is 3 + 4?"))
    return trainer, tokenizer, prompt


def _forward_logprobs(trainer, tokens: list[int]) -> np.ndarray:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:]},
    )
    out = trainer.forward([datum], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].data)


def test_sampled_logprobs_equal_forward_logprobs(trained):
    trainer, _, prompt = trained
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    result = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(result.sequences) == 3
    for seq in result.sequences:
        assert len(seq.tokens) == len(seq.logprobs) > 0
        full = prompt.to_ints() + seq.tokens
        forward = _forward_logprobs(trainer, full)[-len(seq.tokens) :]
        np.testing.assert_allclose(seq.logprobs, forward, atol=2e-4)


def test_base_model_sampling_ignores_adapters(service, tiny_model, trained):
    """The engine switches adapters off for the base and back on for an adapter (once per
    switch, not per forward): each side sees only its own weights, and training still works."""
    trainer, _, prompt = trained
    base = service.create_sampling_client(base_model=str(tiny_model)).result()
    fresh = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    params = types.SamplingParams(max_tokens=8, seed=3)
    seq = base.sample(prompt, 1, params).result().sequences[0]
    full = prompt.to_ints() + seq.tokens
    forward = _forward_logprobs(fresh, full)[-len(seq.tokens) :]
    np.testing.assert_allclose(seq.logprobs, forward, atol=2e-4)

    tuned = _forward_logprobs(trainer, full)
    assert np.abs(tuned[-len(seq.tokens) :] - forward).max() > 1e-3  # the adapter is on
    again = base.sample(prompt, 1, params).result().sequences[0]
    assert again.tokens == seq.tokens
    np.testing.assert_allclose(again.logprobs, seq.logprobs, atol=1e-6)
    np.testing.assert_allclose(_forward_logprobs(trainer, full), tuned, atol=1e-6)

    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:]},
    )
    base.sample(prompt, 1, params).result()  # adapters off again right before training
    fresh.forward_backward([datum], "cross_entropy").result()
    fresh.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    moved = _forward_logprobs(fresh, full)[-len(seq.tokens) :]
    assert moved.sum() > forward.sum() + 1e-3  # it learned the sequence it was shown


def test_same_seed_same_tokens_and_different_seed_differs(trained):
    trainer, _, prompt = trained
    sampler = trainer.save_weights_and_get_sampling_client().result()

    def draw(seed):
        params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=seed)
        return [s.tokens for s in sampler.sample(prompt, 2, params).result().sequences]

    first = draw(123)
    assert draw(123) == first
    assert first[0] != first[1]  # the two samples of one request differ
    assert draw(124) != first


def test_greedy_matches_top_k_one_and_the_argmax(trained):
    trainer, _, prompt = trained
    sampler = trainer.save_weights_and_get_sampling_client().result()
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0))
    top1 = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, top_k=1, seed=9))
    tokens = greedy.result().sequences[0].tokens
    assert tokens == top1.result().sequences[0].tokens
    # Each greedy token is the most likely continuation under a forward pass.
    topk = sampler.sample(
        types.ModelInput.from_ints(prompt.to_ints() + tokens),
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=1,
    ).result()
    best = [row[0][0] for row in topk.topk_prompt_logprobs[-len(tokens) :]]
    assert best == tokens


def test_stop_token_ids_and_strings_are_honoured(trained):
    trainer, tokenizer, prompt = trained
    sampler = trainer.save_weights_and_get_sampling_client().result()
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=20, seed=1)).result()
    tokens = free.sequences[0].tokens
    assert free.sequences[0].stop_reason == "length" and len(tokens) == 20
    # Stop on the 5th sampled token's id: the same seed reproduces the prefix, so the
    # sequence ends at its first occurrence, stop token included.
    stop_id = tokens[4]
    cut = tokens.index(stop_id) + 1
    by_id = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=20, seed=1, stop=[stop_id]))
    seq = by_id.result().sequences[0]
    assert seq.stop_reason == "stop" and seq.tokens == tokens[:cut]
    # Stop on a string the free run produced.
    text = tokenizer.decode(tokens[5:8])
    by_text = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=20, seed=1, stop=[text]))
    seq = by_text.result().sequences[0]
    assert seq.stop_reason == "stop" and text in tokenizer.decode(seq.tokens)
    assert len(seq.tokens) < 20 and seq.tokens == tokens[: len(seq.tokens)]


def test_compute_logprobs_has_one_value_per_prompt_token_first_none(trained):
    trainer, _, prompt = trained
    sampler = trainer.save_weights_and_get_sampling_client().result()
    values = sampler.compute_logprobs(prompt).result()
    ids = prompt.to_ints()
    assert len(values) == len(ids) and values[0] is None
    np.testing.assert_allclose(values[1:], _forward_logprobs(trainer, ids), atol=2e-4)


def test_concurrent_requests_all_complete(trained):
    trainer, _, prompt = trained
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=10, seed=7)
    futures = [sampler.sample(prompt, 1, params) for _ in range(12)]
    results = [f.result() for f in futures]
    # Batched together or not, the same seed yields the same tokens.
    assert all(r.sequences[0].tokens == results[0].sequences[0].tokens for r in results)


def test_sampling_bad_input_answers_4xx(server, service, tiny_model, trained):
    trainer, _, prompt = trained
    sampler = trainer.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.UnprocessableEntityError, match="exceeds the model's context"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=100_000)).result()
    bad = types.ModelInput.from_ints([5, 99999])
    with pytest.raises(tinker.UnprocessableEntityError, match=r"prompt\[1\]: token id 99999"):
        sampler.sample(bad, 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint at tinker://"):
        service.create_sampling_client(model_path="tinker://no-such-run/sampler_weights/x").result()
    for path, fragment in [
        ("tinker://run/sampler_weights/..", "not a valid checkpoint name"),
        ("tinker://../weights/x", "not a valid checkpoint name"),
        ("tinker://run/weights/a/b", "not of the form"),
    ]:
        with pytest.raises(tinker.BadRequestError, match=fragment):
            service.create_sampling_client(model_path=path).result()
    with pytest.raises(tinker.BadRequestError, match="not a valid checkpoint name"):
        trainer.save_state("../escape").result()
    with pytest.raises(tinker.BadRequestError, match="not a valid checkpoint name"):
        trainer.save_weights_for_sampler("a/b").result()
    ok = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    assert len(ok.sequences[0].tokens) == 2


def test_many_concurrent_clients_sample_in_parallel_threads(service, trained):
    trainer, _, prompt = trained
    sampler = trainer.save_weights_and_get_sampling_client().result()

    def one(i):
        params = types.SamplingParams(max_tokens=5, seed=i)
        return sampler.sample(prompt, 2, params).result()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(len(r.sequences) == 2 for r in results)

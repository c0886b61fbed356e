"""The engine's own decode step (decode_step.py, slot_batch.py) on the real tiny model: its
logprobs are the training forward's for a trained adapter, rows of several adapters decode in
one batch as they do alone, identical prompts are prefilled once, compiled and eager decoding
give the same tokens without recompiling per request, and a model it does not know samples
through transformers' forward."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch

from rlcli.server.engine import decode_step
from rlcli.server.engine.batcher import Batcher
from rlcli.server.engine.core import Engine
from rlcli.server.engine.sampling import SampleJob
from rlcli.server.engine.slot_batch import SlotBatch
from rlcli.server.wire import DatumArrays

BF16_LOGP_ATOL = 0.05  # as test_precision.py: bf16 kernels of different shapes round apart


def _engine(model, dtype: str = "float32", **kw) -> Engine:
    """An engine with two trained adapters (LoRA B far from zero) snapshotted as samplers
    "one" and "two"."""
    engine = Engine(str(model), device="cpu", dtype=dtype, **kw)
    for seed, name in enumerate(("one", "two")):
        engine.create_adapter(name, rank=4 + 4 * seed, seed=seed)
        gen = torch.Generator().manual_seed(10 + seed)
        with torch.no_grad():
            for pname, p in engine.peft.named_parameters():
                if "lora_B" in pname and f".{name}." in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        engine.snapshot_sampler(name, name, None, {})
    return engine


@pytest.fixture(scope="module")
def engine(tiny_model):
    return _engine(tiny_model)


def _job(length: int, seed: int | None, sampler: str | None, **kw) -> SampleJob:
    prompt = (np.arange(length, dtype=np.int64) * 7 + 11) % 900 + 5
    kw.setdefault("max_tokens", 12)
    kw.setdefault("num_samples", 2)
    kw.setdefault("temperature", 0.0 if seed is None else 1.0)
    return SampleJob(prompt=prompt, seed=seed, sampler=sampler, stop_at_eos=False, **kw)


def _mixed_jobs() -> list[SampleJob]:
    """Greedy and seeded rows of the base model and both adapters, prompts of four lengths."""
    return [
        _job(3, None, None), _job(9, 5, "one"), _job(17, None, "two"), _job(30, 7, None),
        _job(6, 8, "two", top_p=0.9), _job(12, None, "one"),
    ]  # fmt: skip


def _tokens(outputs) -> list[list[list[int]]]:
    return [[seq[0].tolist() for seq in out.sequences] for out in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampling_logprobs_are_the_training_forwards_for_a_trained_adapter(tiny_model, dtype):
    """What the decode step applies as stacked LoRA is what peft applies in training: the
    importance ratio of each sampled token is 1 up to the dtype's rounding."""
    engine = _engine(tiny_model, dtype)
    assert engine.decode_path == "rlcli llama step"
    prompt = np.arange(5, 25)
    for sampler, model_id in (("one", "one"), ("two", "two")):
        job = SampleJob(prompt=prompt, max_tokens=16, temperature=1.0, seed=3, sampler=sampler)
        (out,) = engine.sample([engine.add_stops(job)])
        tokens, sampled, _ = out.sequences[0]
        full = np.concatenate([prompt, tokens])
        datum = DatumArrays(full[:-1], {"target_tokens": full[1:]})
        (res,), _ = engine.forward_backward(model_id, [datum], "cross_entropy", forward_only=True)
        trained = res["logprobs"][len(prompt) - 1 :]
        atol = 1e-4 if dtype == "float32" else BF16_LOGP_ATOL
        np.testing.assert_allclose(sampled, trained, atol=atol)
    # ...and the adapters matter: the base model gives other logprobs for those tokens.
    base = engine.sample([_job(20, None, None, max_tokens=16, num_samples=1)])[0]
    lora = engine.sample([_job(20, None, "one", max_tokens=16, num_samples=1)])[0]
    assert not np.allclose(base.sequences[0][1], lora.sequences[0][1], atol=1e-3)


def test_rows_of_several_adapters_in_one_batch_match_each_request_alone(engine):
    """Base and two adapters' rows, padded prompts, some joining mid-decode, in one batch (one
    decode pass per step for all): each request gets the tokens it gets alone."""
    jobs = _mixed_jobs()
    alone = [engine.sample([copy.deepcopy(job)])[0] for job in jobs]
    batcher = Batcher(engine)
    replies = dict(batcher.add([(i, copy.deepcopy(jobs[i])) for i in (0, 1, 2)]))
    assert isinstance(batcher.batch, SlotBatch)
    for _ in range(4):
        replies.update(batcher.step())
    replies.update(batcher.add([(i, copy.deepcopy(jobs[i])) for i in (3, 4, 5)]))
    while batcher.busy:
        replies.update(batcher.step())
    assert batcher.stats["batches"] == 1 and batcher.stats["joined"] == 3
    assert batcher.stats["decode_steps"] == 4 + 12  # the late ones' 12 steps overlap
    for i, ref in enumerate(alone):
        for (tokens, logps, _), (ref_tokens, ref_logps, _) in zip(
            replies[i].sequences, ref.sequences, strict=True
        ):
            np.testing.assert_array_equal(tokens, ref_tokens)
            np.testing.assert_allclose(logps, ref_logps, atol=1e-5)


def test_identical_prompts_of_one_sampler_are_prefilled_once(engine):
    """A GRPO group's samples and the same prompt sent again by another request share one
    prefill; another sampler's copy of the prompt gets its own."""
    jobs = [_job(10, 1, "one"), _job(10, 2, "one"), _job(10, 3, "two"), _job(4, 4, "one")]
    batch = engine.decode_batch("one")
    done = batch.admit(jobs, [0, 1, 2, 3])
    while len(batch):
        done += batch.step()
    assert batch.prefills == 3  # (a, 10 tokens), (b, 10 tokens), (a, 4 tokens)
    outputs = dict(done)
    for i, job in enumerate(jobs):
        (ref,) = engine.sample([copy.deepcopy(job)])
        assert _tokens([outputs[i]]) == _tokens([ref])


def test_an_eager_step_runs_only_the_live_rows_and_each_keeps_its_tokens(engine):
    """An RL batch's rows end at different lengths, some join late: the eager step runs on
    exactly the live rows' slots (rows move down into freed ones), and every row still gets
    the tokens it gets alone."""
    jobs = [_job(6 + i, i, "one" if i % 2 else None, max_tokens=2 + 2 * i, num_samples=1)
            for i in range(8)]  # fmt: skip
    batch = engine.decode_batch(None)
    done = batch.admit(copy.deepcopy(jobs[:6]), list(range(6)))
    seen = []
    while len(batch):
        done += batch.step()
        seen.append((len(batch), batch.capacity))
        if len(seen) == 3:  # two more join mid-decode, after the first rows have ended
            done += batch.admit(copy.deepcopy(jobs[6:]), [6, 7])
            seen.append((len(batch), batch.capacity))
    assert all(capacity == rows for rows, capacity in seen), seen
    assert len({rows for rows, _ in seen}) >= 6, seen
    outputs = dict(done)
    # a client that goes away mid-decode (``cancel``, outside a step): the others carry on
    batch = engine.decode_batch(None)
    done = batch.admit(copy.deepcopy(jobs[4:]), [4, 5, 6, 7])
    done += batch.step()
    assert batch.cancel(4) and batch.capacity == len(batch) == 3
    while len(batch):
        done += batch.step()
    assert sorted(dict(done)) == [5, 6, 7]
    assert all(_tokens([out]) == _tokens([outputs[i]]) for i, out in done)
    for i, job in enumerate(jobs):
        (ref,) = engine.sample([copy.deepcopy(job)])
        assert _tokens([outputs[i]]) == _tokens([ref])


def test_compiled_and_eager_decode_give_the_same_tokens_and_compile_once(tiny_model, engine):
    """The compiled step (inductor here) samples what the eager step samples, greedy and
    seeded, base-only and a padded multi-adapter batch; requests after the first reuse its
    graphs (one per batch bucket and LoRA or not), and the engine reports the compile times.
    On a CPU both multiply by oneDNN's packed weights (the graph through their keys)."""
    compiled = _engine(tiny_model, compile=True)
    assert compiled.info()["compile"] == "on"
    assert compiled.decoder.step.packed == engine.decoder.step.packed
    mixed = _mixed_jobs()
    base = [_job(5, None, None, max_tokens=140), _job(8, 2, None, max_tokens=140)]
    eager_out = [engine.sample(copy.deepcopy(jobs)) for jobs in (mixed, base)]
    first = [compiled.sample(copy.deepcopy(jobs)) for jobs in (mixed, base)]
    graphs = compiled.compiled_graphs()
    assert 1 <= graphs <= 3  # 8 slots with LoRA; 4 without (a longer cache: same graph)
    again = [compiled.sample(copy.deepcopy(jobs)) for jobs in (mixed, base)]
    assert compiled.compiled_graphs() == graphs  # no recompiling per request
    for outs in (first, again):
        for mine, ref in zip(outs, eager_out, strict=True):
            assert _tokens(mine) == _tokens(ref)
    info = compiled.info()
    assert info["compiled_graphs"] == graphs and info["compile_seconds"]
    assert all(seconds > 0 for seconds in info["compile_seconds"].values())


def test_a_model_the_step_does_not_know_samples_through_transformers(tiny_model, tmp_path):
    """Another activation function than SwiGLU's: one log line, then transformers' forward
    (one sampler per batch), with the same results as before the decode step existed."""
    other = tmp_path / "gelu"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (other / "config.json").write_text(json.dumps(config))
    engine = Engine(str(other), device="cpu", dtype="float32")
    assert engine.decoder is None and engine.info()["decode_step"] == "transformers"
    batch = engine.decode_batch(None)
    assert not isinstance(batch, SlotBatch) and not batch.accepts("one")
    jobs = [_job(3, None, None), _job(9, 4, None)]
    outs = engine.sample(copy.deepcopy(jobs))
    again = [engine.sample([copy.deepcopy(job)])[0] for job in jobs]
    assert _tokens(outs) == _tokens(again)
    assert len(outs[0].sequences[0][0]) == 12


def test_a_request_for_a_gone_sampler_fails_alone_and_the_others_are_answered_once(engine):
    """Requests of several samplers arrive together and one sampler has expired: it gets
    its error, the others their samples, every request exactly one answer."""
    from rlcli.server.errors import UserError

    batcher = Batcher(engine)
    items = [
        ("base", _job(5, 1, None)), ("gone", _job(5, 2, "ephemeral:no-such-sampler")),
        ("one", _job(7, 3, "one")),
    ]  # fmt: skip
    replies = batcher.add(items)
    while batcher.busy:
        replies += batcher.step()
    assert sorted(rid for rid, _ in replies) == ["base", "gone", "one"]
    answers = dict(replies)
    assert isinstance(answers["gone"], UserError)
    for rid in ("base", "one"):
        assert [len(seq[0]) for seq in answers[rid].sequences] == [12, 12]


def test_compile_is_on_by_default_on_a_gpu_only(monkeypatch):
    """A CPU compile costs 36-53 s per bucket and LoRA layout on SmolLM2 for an 8-16% faster
    step: off there unless asked."""
    monkeypatch.delenv("RLCLI_COMPILE", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not decode_step.compile_wanted(None, cpu) and decode_step.compile_wanted(None, cuda)
    assert decode_step.compile_wanted(True, cpu) and not decode_step.compile_wanted(False, cuda)
    monkeypatch.setenv("RLCLI_COMPILE", "1")
    assert decode_step.compile_wanted(None, cpu)
    monkeypatch.setenv("RLCLI_COMPILE", "0")
    assert not decode_step.compile_wanted(None, cuda)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_give_what_plain_matmuls_give(tiny_model, engine, dtype):
    """On a CPU the step multiplies by oneDNN's packed copies of the weights (the plain
    layout streamed them a third slower): the same tokens, and logprobs within float32's
    rounding of the plain matmuls' (bf16: identical)."""
    engine = engine if dtype == "float32" else _engine(tiny_model, dtype)
    step = engine.decoder.step
    assert step.packed
    jobs = _mixed_jobs() + [_job(7, 9, "one", num_samples=1)]  # one row: float32's gemv path
    packed = engine.sample(copy.deepcopy(jobs))
    step.packed = False
    try:
        plain = engine.sample(copy.deepcopy(jobs))
    finally:
        step.packed = True
    assert _tokens(packed) == _tokens(plain)
    for mine, ref in zip(packed, plain, strict=True):
        for (_, logps, _), (_, ref_logps, _) in zip(mine.sequences, ref.sequences, strict=True):
            np.testing.assert_allclose(logps, ref_logps, atol=1e-4 if dtype == "float32" else 0)


def test_weights_are_not_packed_where_their_copies_would_not_fit(tiny_model, monkeypatch):
    """The packed copies double the weights' memory: without room for them (under half of
    what the kernel says is available), plain matmuls."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(decode_step, "spare_memory", lambda: 0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    assert not decode_step.LlamaStep(model, 64).packed
    assert decode_step.LlamaStep(model, 64, packed=True).packed  # asked for: packed


def test_a_refilled_sampler_adapter_samples_its_own_weights(tiny_model):
    """An RL loop: train, save for sampling, sample, again. Each save moves the client's
    older snapshot out of peft, and the next load refills that spare peft adapter instead of
    building one: the refilled adapter samples the new weights (the training forward's
    logprobs), and peft holds no adapter per step."""
    from rlcli.server.engine.core import SPARE_SAMPLER_SLOTS

    engine = Engine(str(tiny_model), device="cpu", dtype="float32")
    engine.create_adapter("pol", rank=4, seed=0)
    prompt = np.arange(5, 25)
    slots = set()
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for pname, p in engine.peft.named_parameters():
                if "lora_B" in pname and ".pol." in pname:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        engine.snapshot_sampler("pol", f"s{step}", None, {})
        job = SampleJob(prompt=prompt, max_tokens=8, temperature=1.0, seed=step, sampler=f"s{step}")
        (out,) = engine.sample([engine.add_stops(job)])
        slots.add(engine._sampler_slots[engine.samplers.live[f"s{step}"]])
        tokens, sampled, _ = out.sequences[0]
        full = np.concatenate([prompt, tokens])
        datum = DatumArrays(full[:-1], {"target_tokens": full[1:]})
        (res,), _ = engine.forward_backward("pol", [datum], "cross_entropy", forward_only=True)
        np.testing.assert_allclose(sampled, res["logprobs"][len(prompt) - 1 :], atol=1e-4)
    assert len(slots) == 1  # one peft adapter, refilled at every step
    assert len(engine.peft.peft_config) <= 2 + SPARE_SAMPLER_SLOTS


def test_a_sampler_first_loaded_inside_a_batch_samples_alone_later(tiny_model):
    """A request whose sampler is first loaded while a decode batch admits it (under
    inference mode): its peft adapter is still an ordinary one, so sampling from it again
    after another sampler's turn works (it failed with "Setting requires_grad=True on
    inference tensor")."""
    engine = _engine(tiny_model)  # "one" and "two" saved, neither loaded yet
    batch = engine.decode_batch(None)
    done = batch.admit([_job(5, 1, "two")], [0])
    while len(batch):
        done += batch.step()
    for sampler in ("one", "two"):
        (out,) = engine.sample([_job(5, 1, sampler)])
        assert [len(seq[0]) for seq in out.sequences] == [12, 12], out


def test_a_late_request_for_a_running_prompt_copies_its_cache_instead_of_prefilling(engine):
    """The cookbook sends a GRPO group as requests of one sample each, and the later ones
    join a running batch: a prompt (of the same sampler) that a running row has is copied
    from its slot, not prefilled again, and each request still gets the tokens it gets
    alone. Another sampler's copy of the prompt, or one asking for prompt logprobs, is
    prefilled."""
    first = _job(10, 1, "one", num_samples=1, max_tokens=12)
    late = [_job(10, 2, "one", num_samples=1, max_tokens=8), _job(10, 3, "one")]
    other = _job(10, 4, "two", num_samples=1)
    scored = _job(10, 5, "one", num_samples=1, prompt_logprobs=True)
    jobs = [first, *late, other, scored]
    batcher = Batcher(engine)
    replies = dict(batcher.add([(0, copy.deepcopy(first))]))
    replies.update(batcher.step())
    replies.update(batcher.add([(i, copy.deepcopy(jobs[i])) for i in (1, 2)]))
    batch = batcher.batch
    assert (batch.prefills, batch.reused) == (1, 1)
    replies.update(batcher.step())
    replies.update(batcher.add([(i, copy.deepcopy(jobs[i])) for i in (3, 4)]))
    assert (batch.prefills, batch.reused) == (3, 1)
    while batcher.busy:
        replies.update(batcher.step())
    for i, job in enumerate(jobs):
        (ref,) = engine.sample([copy.deepcopy(job)])
        for (tokens, logps, _), (ref_tokens, ref_logps, _) in zip(
            replies[i].sequences, ref.sequences, strict=True
        ):
            np.testing.assert_array_equal(tokens, ref_tokens)
            np.testing.assert_allclose(logps, ref_logps, atol=1e-5)


def test_scoring_the_last_tokens_only_agrees_with_scoring_the_whole_prompt(tiny_model, engine):
    """``prompt_logprobs_last_n`` (a teacher scoring an answer after a document): the prefill
    keeps the last N + 1 positions' logits only (``logits_to_keep``), on our decode step and on
    transformers' forward alike, and their logprobs and top-k equal the full prompt's."""
    from rlcli.server.engine.sampling import logits_to_keep

    def scoring(length, last_n=None):
        return _job(length, None, None, num_samples=1, max_tokens=1, prompt_logprobs=True,
                    topk_prompt_logprobs=3, prompt_logprobs_last_n=last_n)  # fmt: skip

    assert logits_to_keep([scoring(20, 4), scoring(9, 2)]) == 5
    assert logits_to_keep([scoring(20, 4), scoring(9)]) == 0  # one scores all: all kept
    assert logits_to_keep([_job(20, None, None)]) == 1
    other = tiny_model.parent / "gelu-scoring"
    if not other.exists():
        shutil.copytree(tiny_model, other)
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    for eng in (engine, Engine(str(other), device="cpu", dtype="float32")):
        full = eng.sample([scoring(20), scoring(9)])
        tail = eng.sample([scoring(20, 4), scoring(9, 2)])
        for whole, last, n in zip(full, tail, (4, 2), strict=True):
            np.testing.assert_allclose(last.prompt_logprobs[-n:], whole.prompt_logprobs[-n:],
                                       atol=1e-5)  # fmt: skip
            assert np.isnan(last.prompt_logprobs[:-n]).all()
            assert (last.topk_prompt[0][-n:] == whole.topk_prompt[0][-n:]).all()
            np.testing.assert_allclose(last.topk_prompt[1][-n:], whole.topk_prompt[1][-n:],
                                       atol=1e-5)  # fmt: skip


def test_prompts_opening_alike_prefill_the_opening_once_with_the_same_results(engine):
    """Documents before several questions each (a teacher's probes, several chunks in one
    batch): each document's opening is prefilled once (``shared_tokens``), and every prompt's
    scored tokens, top-k and greedy continuation equal that prompt run alone."""
    from rlcli.server.engine.slot_batch import SHARED_PREFIX_MIN, prefix_groups, shared_prefix

    def opening(seed):
        return (np.arange(90, dtype=np.int64) * 13 + seed) % 900 + 5

    def ask(doc, k):
        return np.concatenate([doc, (np.arange(k, dtype=np.int64) + k) * 3 % 900 + 5])

    first, second = opening(7), opening(8)
    prompts = [ask(first, 4), ask(second, 5), ask(first, 11), ask(second, 9), ask(first, 7),
               (np.arange(20, dtype=np.int64) * 5) % 900 + 5]  # fmt: skip
    assert shared_prefix(prompts[0::2][:3], 3) == 90 and shared_prefix(prompts[0::2][:3], 0) == 0
    assert shared_prefix([p[:SHARED_PREFIX_MIN] for p in prompts[:3]], 1) == 0  # too short
    assert shared_prefix(prompts[0::2][:3], 6) == 90 - 2  # the shortest's 6 positions stay out
    assert prefix_groups(prompts, 3) == [([0, 2, 4], 90), ([1, 3], 90), ([5], 0)]

    def job(prompt, sampler):
        return SampleJob(prompt=prompt, seed=None, sampler=sampler, stop_at_eos=False,
                         max_tokens=5, num_samples=1, temperature=0.0, prompt_logprobs=True,
                         topk_prompt_logprobs=3, prompt_logprobs_last_n=3)  # fmt: skip

    for sampler in (None, "one"):
        batch = engine.decode_batch(sampler)
        done = batch.admit([job(p, sampler) for p in prompts], list(range(len(prompts))))
        while len(batch):
            done += batch.step()
        assert batch.shared_tokens == 90 * 2 + 90 * 1
        together = dict(done)
        for i, prompt in enumerate(prompts):
            (alone,) = engine.sample([job(prompt, sampler)])
            got = together[i]
            assert got.sequences[0][0].tolist() == alone.sequences[0][0].tolist()
            np.testing.assert_allclose(got.prompt_logprobs[-3:], alone.prompt_logprobs[-3:],
                                       atol=1e-4)  # fmt: skip
            assert (got.topk_prompt[0][-3:] == alone.topk_prompt[0][-3:]).all()

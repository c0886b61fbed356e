"""Continuous batching on the real engine and tiny model: a request that arrives mid-decode
joins the running batch (one decode pass serves both), seeded rows give the same tokens as
alone, finished rows leave, and an operation of another kind keeps its place in the order."""

from __future__ import annotations

import copy
import queue

import numpy as np
import pytest

from rlcli.server.engine import ops
from rlcli.server.engine.batcher import Batcher
from rlcli.server.engine.core import Engine
from rlcli.server.engine.process import serve
from rlcli.server.engine.sampling import SampleJob
from rlcli.server.errors import UserError


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(str(tiny_model), device="cpu", dtype="float32")


def _job(seed: int, max_tokens: int, num_samples: int = 1, **kw) -> SampleJob:
    prompt = np.array([5, 17, 42, 7, 99, 3][: 3 + seed % 4], dtype=np.int64)
    return SampleJob(prompt=prompt, num_samples=num_samples, max_tokens=max_tokens, seed=seed, **kw)


def _alone(engine, job):
    (out,) = engine.sample([copy.deepcopy(job)])
    return out.sequences


def _run(batcher, replies, steps=None):
    n = 0
    while batcher.busy and (steps is None or n < steps):
        replies.update(batcher.step())
        n += 1


def test_request_arriving_mid_decode_joins_the_running_batch(engine):
    early = _job(1, 24, num_samples=2, temperature=1.0)
    late = _job(2, 8, temperature=0.7, top_p=0.9)
    wide = _job(3, 6, top_k=5)  # a prompt longer than the running cache: the old rows get padded
    wide.prompt = np.arange(10, 50, dtype=np.int64)
    batcher = Batcher(engine)
    replies: dict = {}
    replies.update(batcher.add([("early", copy.deepcopy(early))]))
    _run(batcher, replies, steps=5)
    assert len(batcher.batch) == 2 or "early" in replies  # unless EOS ended both rows early
    replies.update(batcher.add([("late", copy.deepcopy(late)), ("wide", copy.deepcopy(wide))]))
    assert batcher.stats["joined"] == 2
    if "early" not in replies:
        assert len(batcher.batch) == 4  # the late rows decode beside the early ones
    _run(batcher, replies)
    assert set(replies) == {"early", "late", "wide"} and not batcher.busy
    assert batcher.stats["batches"] == 1
    # One pass per step served both: fewer passes than two decodes one after the other.
    assert batcher.stats["decode_steps"] < 24 + 8
    for name, job in (("early", early), ("late", late), ("wide", wide)):
        alone = _alone(engine, job)
        for (tokens, logprobs, _), (tokens1, logprobs1, _) in zip(
            replies[name].sequences, alone, strict=True
        ):
            assert list(tokens) == list(tokens1)  # same seed, same tokens, joined or alone
            np.testing.assert_allclose(logprobs, logprobs1, atol=1e-4)  # and the same logprobs
            assert len(tokens) == len(logprobs) <= job.max_tokens


def test_finished_rows_leave_and_max_tokens_zero_answers_at_once(engine):
    batcher = Batcher(engine)
    replies: dict = {}
    replies.update(batcher.add([("long", _job(3, 20)), ("short", _job(4, 2))]))
    replies.update(batcher.add([("none", _job(5, 0, prompt_logprobs=True))]))
    assert replies["none"].sequences[0][0].size == 0  # answered without a decode step
    assert np.isnan(replies["none"].prompt_logprobs[0])
    _run(batcher, replies, steps=2)
    assert "short" in replies
    assert batcher.batch is None or len(batcher.batch) <= 1  # the short row left the batch
    _run(batcher, replies)
    assert set(replies) == {"long", "short", "none"}


def test_a_failing_request_fails_alone(engine):
    batcher = Batcher(engine)
    replies: dict = {}
    gone = _job(6, 4, sampler="ephemeral:no-such-sampler")
    replies.update(batcher.add([("ok", _job(6, 4)), ("gone", gone), ("ok2", _job(7, 4))]))
    _run(batcher, replies)
    assert isinstance(replies["gone"], UserError)
    assert len(replies["ok"].sequences[0][0]) > 0 and len(replies["ok2"].sequences[0][0]) > 0


def test_another_kind_of_op_runs_after_earlier_samples_and_before_later_ones(engine):
    requests, results = queue.Queue(), queue.Queue()
    for item in [
        ("s1", ops.Sample(_job(8, 12))),
        ("s2", ops.Sample(_job(9, 6))),
        ("op", ops.CreateAdapter(name="ordering", rank=2, seed=0)),
        ("s3", ops.Sample(_job(10, 4))),
        None,
    ]:
        requests.put(item)
    serve(engine, requests, results)
    order = [results.get_nowait()[0] for _ in range(4)]
    assert set(order[:2]) == {"s1", "s2"} and order[2:] == ["op", "s3"]
    engine.remove_adapter("ordering")

"""Rows that begin alike run their common part once (``shared_prefix``): which rows group, how
groups fill micro-batches, and that the engine's two-pass forward gives the plain forward's
logprobs, loss and gradients."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from rlcli.server.engine import shared_prefix
from rlcli.server.engine.core import Engine
from rlcli.server.engine.shared_prefix import Group
from rlcli.server.wire import DatumArrays


def _rows(prompts: list[np.ndarray], answers: list[list[np.ndarray]]):
    """Datum tokens and targets (the sequence shifted by one) of prompt + answer rows."""
    tokens, targets = [], []
    for prompt, group in zip(prompts, answers, strict=True):
        for answer in group:
            seq = np.concatenate([prompt, answer])
            tokens.append(seq[:-1])
            targets.append(seq[1:])
    return tokens, targets


def test_answers_to_one_prompt_group_and_a_common_system_prompt_does_not_join_groups():
    rng = np.random.default_rng(0)
    system = rng.integers(0, 1000, 40)  # shared by every row, above MIN_SHARED
    prompts = [np.concatenate([system, rng.integers(0, 1000, n)]) for n in (60, 90)]
    answers = [[rng.integers(0, 1000, n) for n in (20, 30, 25)], [rng.integers(0, 1000, 50)] * 2]
    tokens, targets = _rows(prompts, answers)
    lone, _ = _rows([rng.integers(0, 1000, 70)], [[rng.integers(0, 1000, 9)]])
    tokens += lone
    targets += [t + 1 for t in lone]
    groups = {frozenset(g.rows): g.shared for g in shared_prefix.find_groups(tokens, targets)}
    # a shared position's target is the next token: the last prompt token's target is each
    # row's first answer token, so the group shares one position less than the prompt
    assert groups == {frozenset({0, 1, 2}): 99, frozenset({3, 4}): 130 + 49 - 1, frozenset({5}): 0}


def test_groups_fill_micro_batches_within_the_budget_and_a_large_group_is_split():
    lengths = [300] * 8 + [100]
    groups = [Group(tuple(range(8)), 200), Group((8,), 0)]
    batches = shared_prefix.microbatches(groups, lengths, budget=700)
    parts = [(g.rows, g.shared) for batch in batches for g in batch]
    # 200 shared + 5 rows x 100 own = 700; the other 3 rows run the shared part again
    assert parts == [((0, 1, 2, 3, 4), 200), ((5, 6, 7), 200), ((8,), 0)]
    assert [len(b) for b in batches] == [1, 2]  # the lone row joins a part that has room
    for batch in batches:
        assert shared_prefix._cost(batch, lengths) <= 700


def _rl_batch(vocab: int) -> list[DatumArrays]:
    """RL-shaped rows: 3 prompts of different lengths x 3 answers, and one row on its own."""
    rng = np.random.default_rng(1)
    data = []
    for p_len in (40, 55, 37):
        prompt = rng.integers(0, vocab, p_len)
        for _ in range(3):
            seq = np.concatenate([prompt, rng.integers(0, vocab, int(rng.integers(5, 30)))])
            answer = (np.arange(len(seq) - 1) >= p_len - 1).astype(np.float32)
            data.append(
                DatumArrays(
                    tokens=seq[:-1],
                    inputs={
                        "target_tokens": seq[1:],
                        "logprobs": -2.0 * answer,
                        "advantages": answer * rng.normal(),
                    },
                )
            )
    seq = rng.integers(0, vocab, 33)
    data.append(DatumArrays(tokens=seq[:-1], inputs={"target_tokens": seq[1:]}))
    return data


def test_the_two_pass_forward_gives_the_plain_logprobs_loss_and_gradients(tiny_model):
    engine = Engine(str(tiny_model), device="cpu", dtype="float32", microbatch_tokens=4096)
    assert engine.share_prefixes and engine.info()["shared_prefixes"]
    engine.create_adapter("pol", rank=4, seed=0)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # LoRA B starts at 0: make the adapter count
        for p in engine.adapters["pol"].params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    data = _rl_batch(engine.vocab_size)
    data[-1].inputs.update(logprobs=np.zeros(32, np.float32), advantages=np.ones(32, np.float32))
    plan = engine._plan(data)
    shared = sorted({start for _, spec in plan for _, start in spec})
    assert shared == [0, 36, 39, 54], plan  # three groups and the row on its own

    def run(share: bool):
        engine.share_prefixes = share
        engine.adapters["pol"].optimizer.zero_grad(set_to_none=True)
        outputs, metrics = engine.forward_backward("pol", data, "importance_sampling")
        grads = torch.cat([p.grad.flatten() for p in engine.adapters["pol"].params])
        return outputs, metrics, grads

    plain, shared_run = run(False), run(True)
    for mine, ref in zip(shared_run[0], plain[0], strict=True):
        np.testing.assert_allclose(mine["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
    assert shared_run[1]["loss:sum"] == pytest.approx(plain[1]["loss:sum"], abs=1e-5)
    error = (shared_run[2] - plain[2]).norm() / plain[2].norm()
    assert error < 1e-5, error


def test_a_model_with_sliding_window_layers_keeps_the_plain_pass(tiny_model, tmp_path):
    """The 4D mask knows no sliding window, and a short start-up probe would not see one."""
    folder = tmp_path / "windowed"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    config.pop("layer_types", None)
    (folder / "config.json").write_text(json.dumps(config))
    engine = Engine(str(folder), device="cpu", dtype="float32", microbatch_tokens=4096)
    assert not engine.share_prefixes
    data = _rl_batch(engine.vocab_size)
    assert all(start == 0 for _, spec in engine._plan(data) for _, start in spec)

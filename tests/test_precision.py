"""Chunked logprobs, gradient checkpointing and bf16 against the plain float32 path.

The plain path is what the engine did before: the whole model's logits in float32, one
``log_softmax``, one backward. Chunking and checkpointing only reorder float32 arithmetic, so
they match it to rounding; bf16 weights match within the tolerance in docs/architecture.md
("Precision"): BF16_LOGPROB_ATOL per token (BF16_LOGPROB_MEAN_ATOL on average), and the
LoRA gradient within BF16_GRAD_COSINE of the float32 direction.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlcli.server import logprobs
from rlcli.server.engine import Engine
from rlcli.server.wire import DatumArrays

BF16_LOGPROB_ATOL = 0.05  # max |bf16 - fp32| per token (measured on the tiny model: 0.024)
BF16_LOGPROB_MEAN_ATOL = 0.01  # mean |bf16 - fp32| per token (measured: 0.0025)
BF16_GRAD_COSINE = 0.999  # cosine of the whole LoRA gradient (measured: 0.9997)
BF16_RATIO_LOG_ATOL = 0.02  # |sampler - training| logprob in bf16, same weights (measured: 0.005)


def _data(vocab: int, k: int | None = None) -> list[DatumArrays]:
    rng = np.random.default_rng(0)
    out = []
    for n in (37, 20, 9):
        tokens = rng.integers(0, vocab, n)
        shape = (n,) if k is None else (n, k)
        targets = rng.integers(0, vocab, shape)
        weights = rng.random(shape).astype(np.float32)
        out.append(DatumArrays(tokens, {"target_tokens": targets, "weights": weights}))
    return out


def _engine(model, **kw) -> Engine:
    engine = Engine(str(model), device="cpu", **kw)
    engine.create_adapter("student", rank=4, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at 0 (no gradient reaches A): make both nonzero
        for p in engine.adapters["student"].params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return engine


def _run(engine: Engine, data) -> tuple[np.ndarray, torch.Tensor]:
    outputs, _ = engine.forward_backward("student", data, "cross_entropy")
    params = engine.adapters["student"].params
    grad = torch.cat([p.grad.flatten() for p in params]).clone()
    engine.adapters["student"].optimizer.zero_grad(set_to_none=True)
    return np.concatenate([o["logprobs"].ravel() for o in outputs]), grad


def _plain(engine: Engine, data) -> tuple[np.ndarray, torch.Tensor]:
    """The unchunked, uncheckpointed float32 path, written out in the test."""
    engine._set_adapter("student")
    logps, total = [], 0.0
    for d in data:
        tokens = torch.from_numpy(d.tokens)[None]
        targets = torch.from_numpy(d.inputs["target_tokens"])
        weights = torch.from_numpy(d.inputs["weights"])
        logits = engine.peft(input_ids=tokens).logits.float()[0].log_softmax(-1)
        t = targets if targets.dim() == 2 else targets[:, None]
        logp = logits.gather(-1, t).reshape(targets.shape)
        total = total - (logp * weights).sum()
        logps.append(logp.detach().numpy().ravel())
    total.backward()
    params = engine.adapters["student"].params
    grad = torch.cat([p.grad.flatten() for p in params]).clone()
    engine.adapters["student"].optimizer.zero_grad(set_to_none=True)
    return np.concatenate(logps), grad


def _relative_error(grad: torch.Tensor, ref: torch.Tensor) -> float:
    """|grad - ref| / |ref| over the whole LoRA gradient (elementwise, sums in another order
    differ by rounding on the tiny entries)."""
    return float((grad - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def fp32(tiny_model):
    return _engine(tiny_model, dtype="float32", grad_checkpointing=False)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(logprobs, "CHUNK_TOKENS", 16)  # several chunks per micro-batch


@pytest.mark.parametrize("k", [None, 3], ids=["targets", "top3_targets"])
def test_chunked_logprobs_match_the_plain_path(fp32, small_chunks, k):
    data = _data(fp32.vocab_size, k)
    logp, grad = _run(fp32, data)
    ref_logp, ref_grad = _plain(fp32, data)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    assert _relative_error(grad, ref_grad) < 1e-5


def test_checkpointing_recomputes_layers_and_matches(tiny_model, fp32, small_chunks):
    engine = _engine(tiny_model, dtype="float32", grad_checkpointing=True)
    assert engine.grad_checkpointing
    # A layer's recomputation stops once it has what the backward needs, so count the
    # attention's calls (the layer's own forward hook would fire once).
    layer = engine._checkpoint_layers[0].self_attn
    calls = []
    hook = layer.register_forward_hook(lambda *_: calls.append(1))
    data = _data(engine.vocab_size)
    logp, grad = _run(engine, data)
    hook.remove()
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    assert not any(m.training for m in engine._checkpoint_layers)  # sampling keeps its cache
    ref_logp, ref_grad = _plain(fp32, data)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    assert _relative_error(grad, ref_grad) < 1e-5
    with torch.no_grad():  # forward-only passes run the layers once
        calls.clear()
        hook = layer.register_forward_hook(lambda *_: calls.append(1))
        engine.forward_backward("student", data, "cross_entropy", forward_only=True)
        hook.remove()
    assert len(calls) == 1


def test_auto_checkpointing_on_cpu_recomputes_only_rows_over_the_budget(tiny_model, fp32):
    """By default a CPU engine takes micro-batches of 512 tokens and checkpoints none of them;
    a row longer than the budget (it cannot be split) is checkpointed, and both match."""
    default = Engine(str(tiny_model), device="cpu", dtype="float32")
    assert default.microbatch_tokens == 512 and default.grad_checkpointing
    assert default.info()["grad_checkpointing"] == "above 512 tokens"
    engine = _engine(tiny_model, dtype="float32", microbatch_tokens=24)
    layer = engine._checkpoint_layers[0].self_attn
    data = _data(engine.vocab_size)  # rows of 37, 20 and 9 tokens: 37 alone is over 24
    calls = []
    hook = layer.register_forward_hook(lambda *_: calls.append(1))
    logp, grad = _run(engine, data)
    hook.remove()
    # micro-batches [37], [20], [9]: only the first is recomputed in its backward
    assert len(calls) == 4
    ref_logp, ref_grad = _plain(fp32, data)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    assert _relative_error(grad, ref_grad) < 1e-5


def test_grouped_attention_matches_transformers_sdpa_with_a_mask(fp32):
    """A CPU engine runs grouped-query attention without repeating keys and values; with a
    padding mask it gives transformers' sdpa result and gradients (the tiny model has 4 query
    heads per 2 key/value heads; every padded batch above goes through it too)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rlcli.server import attention

    assert fp32.model.config._attn_implementation == attention.NAME
    module = fp32.model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 5, 16, generator=gen, requires_grad=True)
    k = torch.randn(3, 2, 9, 16, generator=gen, requires_grad=True)
    v = torch.randn(3, 2, 9, 16, generator=gen, requires_grad=True)
    mask = torch.ones(3, 1, 5, 9, dtype=torch.bool).tril(4)
    mask[0, ..., :3] = False  # a left-padded row
    outs, grads = [], []
    for fn in (attention.grouped_sdpa_forward, sdpa_attention_forward):
        out, _ = fn(module, q, k, v, mask, scaling=0.25)
        outs.append(out.detach())
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    for mine, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_microbatch_tokens_below_one_is_refused_not_replaced_by_the_default(capsys):
    """0 is a mistake, not "auto": the engine and ``python -m rlcli.server`` both refuse it."""
    from rlcli.server.__main__ import main as server_main
    from rlcli.server.engine import pick_microbatch_tokens

    cpu = torch.device("cpu")
    assert pick_microbatch_tokens(None, cpu) == 512 and pick_microbatch_tokens(7, cpu) == 7
    with pytest.raises(ValueError, match="at least 1"):
        pick_microbatch_tokens(0, cpu)
    with pytest.raises(SystemExit) as exited:
        server_main(["--base-model", "x", "--microbatch-tokens", "0"])
    assert exited.value.code == 2
    assert "--microbatch-tokens: must be at least 1" in capsys.readouterr().err


def test_bf16_weights_match_fp32_within_tolerance_and_keep_fp32_lora(tiny_model, fp32):
    engine = _engine(tiny_model, dtype="bfloat16")
    assert engine.model.get_output_embeddings().weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in engine.adapters["student"].params)
    data = _data(engine.vocab_size)
    logp, grad = _run(engine, data)
    ref_logp, ref_grad = _plain(fp32, data)
    err = np.abs(logp - ref_logp)
    assert err.max() <= BF16_LOGPROB_ATOL, err.max()
    assert err.mean() <= BF16_LOGPROB_MEAN_ATOL, err.mean()
    cosine = torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0)
    assert cosine >= BF16_GRAD_COSINE, cosine
    engine.forward_backward("student", data, "cross_entropy")
    engine.optim_step("student", learning_rate=1e-3)
    state = engine.adapters["student"].optimizer.state
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampler_and_training_logprobs_agree_when_weights_have_not_moved(tiny_model, dtype):
    """Importance ratios are 1 up to rounding: sampling runs the same weights in the same dtype
    (the engine's), so its logprobs are the training forward's."""
    from rlcli.server.sampling import SampleJob

    engine = _engine(tiny_model, dtype=dtype)
    engine.snapshot_sampler("student", "snap", None, {})
    prompt = np.arange(5, 25)
    job = SampleJob(prompt=prompt, max_tokens=12, temperature=1.0, seed=3, sampler="snap")
    (out,) = engine.sample([job])
    tokens, sampled, _ = out.sequences[0]
    full = np.concatenate([prompt, tokens])
    datum = DatumArrays(full[:-1], {"target_tokens": full[1:]})
    (res,), _ = engine.forward_backward("student", [datum], "cross_entropy", forward_only=True)
    trained = res["logprobs"][len(prompt) - 1 :]
    # KV-cache decode and a full forward run different kernel shapes: rounding, not precision.
    atol = 1e-4 if dtype == "float32" else BF16_RATIO_LOG_ATOL
    np.testing.assert_allclose(sampled, trained, atol=atol)

"""Chunked logprobs, gradient checkpointing and bf16 against the plain float32 path.

The plain path is what the engine did before: the whole model's logits in float32, one
``log_softmax``, one backward. Chunking and checkpointing only reorder float32 arithmetic, so
they match it to rounding; bf16 weights match within the tolerance in docs/precision.md
("Tolerances"): BF16_LOGPROB_ATOL per token (BF16_LOGPROB_MEAN_ATOL on average), and the
LoRA gradient within BF16_GRAD_COSINE of the float32 direction.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlcli.server.engine import activations, logprobs, precision
from rlcli.server.engine.core import Engine
from rlcli.server.wire import DatumArrays

BF16_LOGPROB_ATOL = 0.05  # max |bf16 - fp32| per token (measured on the tiny model: 0.024)
BF16_LOGPROB_MEAN_ATOL = 0.01  # mean |bf16 - fp32| per token (measured: 0.0025)
BF16_GRAD_COSINE = 0.999  # cosine of the whole LoRA gradient (measured: 0.9997)
BF16_RATIO_LOG_ATOL = 0.02  # |sampler - training| logprob in bf16, same weights (measured: 0.0014)
# A decode row's logprobs in a batch of mixed lengths (and joining it mid-decode) vs alone, same
# seed: equal tokens, and logprobs within this in bf16 (measured 0.0014; float32 1e-6).
BF16_BATCH_LOGP_ATOL = 0.01
# A small LoRA update (B ~ 1e-4): the change it makes to bf16 logprobs vs the change in float32,
# relative L2 error (measured 0.29 with float32 results of bf16 matmuls, 0.73 with bf16 ones).
BF16_LORA_DELTA_RTOL = 0.4


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


@pytest.mark.parametrize("recompute", [False, True], ids=["softmax_kept", "recomputed"])
def test_target_logprobs_run_the_head_once_unless_recomputing_and_match_log_softmax(recompute):
    """Kept softmax: the head runs once per chunk; recomputed: twice. Either way the
    logprobs and the gradient (targets repeated within a row too) are log_softmax's."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=gen)
    hidden = torch.randn(21, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (21, 3), generator=gen)
    targets[:, 1] = targets[:, 0]  # the same token twice: its gradients add
    g = torch.randn(21, 3, generator=gen)
    calls = []

    def head(h):
        calls.append(1)
        return h @ weight.t()

    got = logprobs.target_logprobs(hidden, head, targets, chunk=8, recompute=recompute)
    (grad,) = torch.autograd.grad((got * g).sum(), hidden)
    assert len(calls) == (6 if recompute else 3)
    ref = (hidden @ weight.t()).log_softmax(-1).gather(-1, targets)
    (ref_grad,) = torch.autograd.grad((ref * g).sum(), hidden)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


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
    """By default a float32 CPU engine takes micro-batches of 512 tokens and checkpoints none
    of them; a row longer than the budget (it cannot be split) is checkpointed, and both
    match."""
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

    from rlcli.server.engine import attention

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
    from rlcli.server.engine.hardware import pick_microbatch_tokens

    cpu = torch.device("cpu")
    assert pick_microbatch_tokens(7, cpu) == 7
    with pytest.raises(ValueError, match="at least 1"):
        pick_microbatch_tokens(0, cpu)
    with pytest.raises(SystemExit) as exited:
        server_main(["--base-model", "x", "--microbatch-tokens", "0"])
    assert exited.value.code == 2
    assert "--microbatch-tokens: must be at least 1" in capsys.readouterr().err


def test_the_cpu_default_micro_batch_is_fixed_whatever_the_dtype_and_free_memory():
    """A CPU takes 512-token micro-batches in bf16 and float32 alike, however much memory is
    free (the step's peak must not grow with the machine); a GPU takes 4096."""
    from rlcli.server.engine.hardware import pick_microbatch_tokens

    assert pick_microbatch_tokens(None, torch.device("cpu")) == 512
    assert pick_microbatch_tokens(None, torch.device("cuda")) == 4096


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


def _saved_bytes(engine: Engine, data, monkeypatch) -> tuple[int, int]:
    """Bytes a training forward keeps for its backward, besides weights: (kept as they are,
    kept as bf16 copies), each stored tensor counted once."""
    kept: dict[int, int] = {}
    copies: dict[int, int] = {}

    def note(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    pack = activations._Compactor.pack

    def spy(self, t):
        out = pack(self, t)
        if out is t:
            note(t)
        else:
            copies[id(out)] = out.tensor.untyped_storage().nbytes()
        return out

    monkeypatch.setattr(activations, "MIN_ELEMENTS", 1)  # the tiny model's tensors are small
    monkeypatch.setattr(activations._Compactor, "pack", spy)
    monkeypatch.setattr(activations, "_same", note)  # attention's inputs (exact())
    module = engine._activate("student")
    with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
        engine._target_logprobs(module, data, ("target_tokens", "weights"), None)
    return sum(kept.values()), sum(copies.values())


def test_a_bf16_cpu_training_forward_keeps_half_the_bytes_for_its_backward(
    tiny_model, fp32, monkeypatch
):
    """What the backward reads is kept as bf16 copies of the float32 activations (attention's
    inputs excepted; activations.py), each copied once however many layers read it (q, k and
    v share an input): under 0.6x the bytes kept without copies, with logprobs unchanged and
    the gradient within the bf16 tolerance of float32's. The engine's peak memory in bf16 on a
    CPU grew back to twice this when the copies were not made."""
    engine = _engine(tiny_model, dtype="bfloat16")
    assert engine._compact_activations
    data = _data(engine.vocab_size)
    compact_logp, compact_grad = _run(engine, data)
    kept, copies = _saved_bytes(engine, data, monkeypatch)
    engine._compact_activations = False
    plain_logp, plain_grad = _run(engine, data)
    plain, none = _saved_bytes(engine, data, monkeypatch)
    assert copies and not none
    assert kept + copies < 0.6 * plain, (kept, copies, plain)
    np.testing.assert_array_equal(compact_logp, plain_logp)  # the forward is untouched
    _, ref_grad = _plain(fp32, data)
    cosine = torch.nn.functional.cosine_similarity(compact_grad, ref_grad, dim=0)
    assert cosine >= BF16_GRAD_COSINE, cosine
    assert torch.nn.functional.cosine_similarity(compact_grad, plain_grad, dim=0) > 0.9999


def test_nothing_of_a_training_step_stays_alive_after_it(tiny_model):
    """A step (forward_backward + optim_step) leaves no graph, activation or copy behind: no
    tensor with a graph is alive after it, and the tensors alive after the third step are
    those alive after the first (the model, the adapter, its optimizer state)."""
    import gc

    def live() -> tuple[int, set[int]]:
        """Bytes of the tensors alive, and which of them belong to a graph."""
        gc.collect()
        storages, graphs = {}, set()
        for t in gc.get_objects():
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                if t.grad_fn is not None:
                    graphs.add(id(t))
        return sum(storages.values()), graphs

    def live_bytes() -> int:
        size, graphs = live()
        assert graphs <= before  # no output of a step keeps its graph (and what it saved)
        return size

    _, before = live()  # (other tests' leftovers in this process)
    engine = _engine(tiny_model, dtype="bfloat16")
    data = _data(engine.vocab_size)
    sizes = []
    for _ in range(3):
        engine.forward_backward("student", data, "cross_entropy")
        engine.optim_step("student", learning_rate=1e-3)
        sizes.append(live_bytes())
    assert sizes[2] == sizes[0], sizes


def test_the_output_layer_is_float32_forward_and_takes_its_gradient_through_bf16():
    """Logits are the float32 product; the hidden states' gradient is the bf16 product, as a
    ``Bf16Linear`` below computes its own, and within bf16 rounding of the float32 one."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 300, bias=False).to(torch.bfloat16)
    precision.mixed_precision(
        SimpleNamespace(get_output_embeddings=lambda: head, modules=lambda: [head])
    )
    assert isinstance(head, precision.Float32Head)
    x = torch.randn(7, 64, requires_grad=True)
    logits = head(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(x, head.weight32))
    grad = torch.randn_like(logits)
    logits.backward(grad)
    assert torch.equal(x.grad, (grad.bfloat16() @ head.weight).float())
    exact = grad @ head.weight32
    assert float((x.grad - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampler_and_training_logprobs_agree_when_weights_have_not_moved(tiny_model, dtype):
    """Importance ratios are 1 up to rounding: sampling runs the same weights in the same dtype
    (the engine's), so its logprobs are the training forward's."""
    from rlcli.server.engine.sampling import SampleJob

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


def _sampling_engine(model, dtype: str) -> Engine:
    engine = _engine(model, dtype=dtype)
    engine.snapshot_sampler("student", "snap", None, {})
    return engine


def _job(length: int, seed: int):
    from rlcli.server.engine.sampling import SampleJob

    prompt = np.arange(3, 3 + length)
    job = SampleJob(prompt=prompt, num_samples=2, max_tokens=16, seed=seed, sampler="snap")
    return job


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_batch_of_mixed_lengths_gives_each_row_its_tokens_alone(tiny_model, dtype):
    """Rows left-padded beside longer prompts, or joining a batch mid-decode, get the tokens
    they get alone (same seed) and logprobs within the documented tolerance."""
    engine = _sampling_engine(tiny_model, dtype)
    lengths = [3, 9, 17, 30]
    jobs = [engine.add_stops(_job(n, seed)) for seed, n in enumerate(lengths)]
    alone = [engine.sample([engine.add_stops(_job(n, seed))])[0] for seed, n in enumerate(lengths)]
    together = engine.sample(jobs)
    batch = engine.decode_batch("snap")  # two rows start, two join after 4 steps
    joined = batch.admit([jobs[0], jobs[2]], [0, 2])
    for _ in range(4):
        joined += batch.step()
    joined += batch.admit([jobs[1], jobs[3]], [1, 3])
    while len(batch):
        joined += batch.step()
    atol = 1e-5 if dtype == "float32" else BF16_BATCH_LOGP_ATOL
    for outputs in (together, [out for _, out in sorted(joined, key=lambda x: x[0])]):
        for mine, ref in zip(outputs, alone, strict=True):
            for (tokens, logps, _), (ref_tokens, ref_logps, _) in zip(
                mine.sequences, ref.sequences, strict=True
            ):
                np.testing.assert_array_equal(tokens, ref_tokens)
                np.testing.assert_allclose(logps, ref_logps, atol=atol)


def _lora_delta(model, dtype: str, plain_bf16: bool = False) -> np.ndarray:
    """The change in training logprobs that setting LoRA B to small values (~1e-4) makes."""
    engine = Engine(str(model), device="cpu", dtype=dtype)
    if plain_bf16:  # what peft does on bf16 Linears: LoRA added to the rounded bf16 output
        for module in engine.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.__class__ = torch.nn.Linear
    engine.create_adapter("student", rank=4, seed=0)
    data = [
        DatumArrays(d.tokens, {"target_tokens": d.inputs["target_tokens"]}) for d in _data(1024)
    ]

    def logp():
        outputs, _ = engine.forward_backward("student", data, "cross_entropy", forward_only=True)
        return np.concatenate([o["logprobs"] for o in outputs])

    before = logp()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in engine.peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-4)
    return logp() - before


def test_a_small_lora_update_survives_bf16_rounding(tiny_model):
    """bf16 matmuls return float32 (precision.py), so the LoRA branch is added to an unrounded
    sum: a LoRA step as small as RL's first ones moves bf16 logprobs as it moves float32's.
    Added to bf16 outputs (peft's default) most of it is rounded away."""
    from rlcli.server.engine import precision

    engine = Engine(str(tiny_model), device="cpu", dtype="bfloat16")
    kinds = {type(m) for m in engine.model.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {precision.Bf16Linear, precision.Float32Head}
    ref = _lora_delta(tiny_model, "float32")
    mixed = _lora_delta(tiny_model, "bfloat16")
    plain = _lora_delta(tiny_model, "bfloat16", plain_bf16=True)
    error = np.linalg.norm(mixed - ref) / np.linalg.norm(ref)
    plain_error = np.linalg.norm(plain - ref) / np.linalg.norm(ref)
    assert error <= BF16_LORA_DELTA_RTOL, (error, plain_error)
    assert plain_error > 2 * error, (error, plain_error)

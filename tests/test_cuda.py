"""The CUDA path, on a lent GPU (``benchmarks/device_check.sh`` runs ``-m cuda``): the decode
step in bf16 on the device agrees with training's forward for trained adapters, its compiled
graph (inductor; the default on a GPU) samples what the eager one does, and a server started
with ``--device cuda`` trains and samples through the SDK. Skipped where torch sees no GPU."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import start_server
from rlcli.server.engine.core import Engine
from rlcli.server.engine.sampling import SampleJob
from rlcli.server.wire import DatumArrays
from test_decode_step import BF16_LOGP_ATOL, _job, _mixed_jobs, _tokens

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def _engine(model, **kw) -> Engine:
    """A bf16 engine on the GPU with one trained adapter, snapshotted as sampler "one"."""
    engine = Engine(str(model), device="cuda", dtype="bfloat16", **kw)
    engine.create_adapter("one", rank=8, seed=0)
    gen = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for name, p in engine.peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen).to(p.device) * 0.05)
    engine.snapshot_sampler("one", "one", None, {})
    return engine


def test_gpu_sampling_logprobs_are_the_training_forwards(tiny_model):
    engine = _engine(tiny_model, compile=False)
    assert engine.decode_path == "rlcli llama step"
    prompt = np.arange(5, 25)
    job = SampleJob(prompt=prompt, max_tokens=16, temperature=1.0, seed=3, sampler="one")
    (out,) = engine.sample([engine.add_stops(job)])
    tokens, sampled, _ = out.sequences[0]
    full = np.concatenate([prompt, tokens])
    datum = DatumArrays(full[:-1], {"target_tokens": full[1:]})
    (res,), _ = engine.forward_backward("one", [datum], "cross_entropy", forward_only=True)
    np.testing.assert_allclose(sampled, res["logprobs"][len(prompt) - 1 :], atol=BF16_LOGP_ATOL)


def test_gpu_compiled_decode_samples_what_eager_does_and_compiles_once(tiny_model):
    eager, compiled = _engine(tiny_model, compile=False), _engine(tiny_model)
    assert compiled.info()["compile"] == "on"  # the default on a GPU
    jobs = [job for job in _mixed_jobs() if job.sampler in (None, "one")]
    jobs += [_job(8, None, None, max_tokens=40)]
    want = eager.sample(copy.deepcopy(jobs))
    assert _tokens(compiled.sample(copy.deepcopy(jobs))) == _tokens(want)
    graphs = compiled.compiled_graphs()
    assert _tokens(compiled.sample(copy.deepcopy(jobs))) == _tokens(want)
    assert compiled.compiled_graphs() == graphs


def test_a_cuda_server_trains_and_samples_through_the_sdk(tmp_path, tiny_model):
    import tinker
    from tinker import types

    from rlcli.launch import process

    record = start_server(tmp_path / "home", tiny_model, device="cuda", dtype="bfloat16")
    try:
        service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
        trainer = service.create_lora_training_client(base_model=str(tiny_model), rank=8).result()
        ids = list(range(5, 40))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        losses = []
        for _ in range(4):
            out = trainer.forward_backward([datum], "cross_entropy").result()
            losses.append(out.metrics["loss:sum"])
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert losses[-1] < losses[0]
        sampler = trainer.save_weights_and_get_sampling_client("cuda")
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1)
        result = sampler.sample(types.ModelInput.from_ints(ids[:5]), 4, params).result()
        assert len(result.sequences) == 4
        assert all(0 < len(s.tokens) <= 8 for s in result.sequences)
    finally:
        process.stop(tmp_path / "home")

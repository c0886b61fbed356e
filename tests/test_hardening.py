"""Server hardening (issue 8), as a hostile or unlucky client finds it: through the unmodified
SDK and raw HTTP against a real server process with the tiny model.

Invariants under test (docs/architecture.md): no non-finite value reaches an adapter; every
request gets an answer; a checkpoint name resolves to one complete checkpoint; a sampler path
serves exactly the weights saved under it.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def tokens():
    return [5, 6, 7, 8, 9, 10]


def _datum(tokens, **inputs) -> types.Datum:
    n = len(tokens)
    loss_fn_inputs = {"target_tokens": [t + 1 for t in tokens]}
    loss_fn_inputs.update({k: v for k, v in inputs.items() if v is not None})
    assert all(len(v) == n for v in loss_fn_inputs.values())
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens)), loss_fn_inputs=loss_fn_inputs
    )


def _ce_loss(trainer, tokens) -> float:
    return trainer.forward([_datum(tokens)], "cross_entropy").result().metrics["loss:sum"]


def _raw(server, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"X-API-Key": "tml-dummy", **kwargs.pop("headers", {})}
    return httpx.request(method, server.base_url + path, headers=headers, timeout=30, **kwargs)


def _refused(call) -> str:
    """Run ``call``; it must fail as a user error (400 at submit, or a future failed with
    category user). Returns the message."""
    refusals = (tinker.BadRequestError, tinker.UnprocessableEntityError, tinker.RequestFailedError)
    with pytest.raises(refusals) as info:
        call()
    if isinstance(info.value, tinker.RequestFailedError):
        assert info.value.category == tinker.types.RequestErrorCategory.User, info.value
    return str(info.value)


# ---- numerical safety ------------------------------------------------------------------------


def test_extreme_finite_inputs_are_refused_and_change_nothing(service, tiny_model, tokens):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=1
    ).result()
    trainer.forward_backward([_datum(tokens)], "cross_entropy").result()  # a pending gradient
    before = _ce_loss(trainer, tokens)
    n = len(tokens)
    bad = [
        ([_datum(tokens, weights=[1e30] * n)], "cross_entropy", None),
        (
            [_datum(tokens, logprobs=[-1e30] * n, advantages=[1.0] * n)],
            "importance_sampling",
            None,
        ),
        ([_datum(tokens, logprobs=[-1e30] * n, advantages=[1.0] * n)], "ppo", None),
    ]
    for data, loss, config in bad:
        message = _refused(
            lambda d=data, ls=loss, c=config: trainer.forward_backward(d, ls, c).result()
        )
        assert "not finite" in message
    # The pending (finite) gradient survived the refused calls: one step applies exactly it.
    result = trainer.optim_step(ADAM).result()
    assert math.isfinite(result.metrics["grad_norm:mean"]) and result.metrics["grad_norm:mean"] > 0
    after = _ce_loss(trainer, tokens)
    assert math.isfinite(after) and after < before


def test_zero_advantage_tokens_with_wild_sampler_logprobs_give_a_finite_loss(
    service, tiny_model, tokens
):
    """exp(logp - q) with q = -200 overflows; on a token with advantage 0 it must not count
    (before: inf * 0 = NaN and a 500 the SDK retried forever)."""
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=2
    ).result()
    n = len(tokens)
    adv = [0.0] * (n - 2) + [1.0, 1.0]
    q = [-200.0] * (n - 2) + [-3.0, -3.0]
    for loss in ("importance_sampling", "ppo", "cispo"):
        out = trainer.forward_backward([_datum(tokens, logprobs=q, advantages=adv)], loss).result()
        assert math.isfinite(out.metrics["loss:sum"]), loss
    step = trainer.optim_step(ADAM).result()
    assert math.isfinite(step.metrics["grad_norm:mean"])
    assert math.isfinite(_ce_loss(trainer, tokens))


def test_bad_loss_config_and_adam_values_are_400s_naming_the_field(
    server, service, tiny_model, tokens
):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=3
    ).result()
    n = len(tokens)
    rl = [_datum(tokens, logprobs=[-1.0] * n, advantages=[1.0] * n)]
    for config, fragment in (
        ({"clip_low_threshold": float("nan")}, "clip_low_threshold"),
        ({"clip_low_threshold": -1.0}, "clip_low_threshold"),
        ({"clip_low_threshold": 1.5, "clip_high_threshold": 1.2}, "above clip_high_threshold"),
    ):
        assert fragment in _refused(
            lambda c=config: trainer.forward_backward(rl, "ppo", c).result()
        )
    assert "beta2" in _refused(lambda: trainer.optim_step(types.AdamParams(beta2=2.0)).result())
    model_id = trainer.model_id
    for raw_body, field in (
        ('{"model_id": "%s", "adam_params": {"learning_rate": NaN}}', "learning_rate"),
        ('{"model_id": "%s", "adam_params": {"learning_rate": Infinity}}', "learning_rate"),
        ('{"model_id": "%s", "adam_params": {"eps": 0}}', "eps"),
        ('{"model_id": "%s", "adam_params": {"learning_rate": "abc"}}', "learning_rate"),
    ):
        response = _raw(
            server,
            "POST",
            "/api/v1/optim_step",
            content=raw_body % model_id,
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 422, response.text
        assert field in response.json()["detail"]
    assert math.isfinite(_ce_loss(trainer, tokens))


def test_a_step_that_would_overflow_the_weights_is_undone(service, tiny_model, tokens):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=4
    ).result()
    trainer.forward_backward([_datum(tokens)], "cross_entropy").result()
    before = _ce_loss(trainer, tokens)
    message = _refused(lambda: trainer.optim_step(types.AdamParams(learning_rate=1e38)).result())
    assert "undone" in message
    assert _ce_loss(trainer, tokens) == pytest.approx(before, rel=1e-6)


# ---- Tinker behaviour ------------------------------------------------------------------------


def test_cross_entropy_datums_are_self_contained(service, tiny_model, tokens):
    """One datum with weights, one without (meaning all ones): same as sending the ones."""
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=5
    ).result()
    n = len(tokens)
    mixed = [_datum(tokens, weights=[0.5] * n), _datum(tokens[::-1])]
    explicit = [_datum(tokens, weights=[0.5] * n), _datum(tokens[::-1], weights=[1.0] * n)]
    a = trainer.forward(mixed, "cross_entropy").result().metrics["loss:sum"]
    b = trainer.forward(explicit, "cross_entropy").result().metrics["loss:sum"]
    assert a == pytest.approx(b, rel=1e-6)


def test_top_k_cross_entropy_returns_n_by_k_logprobs(service, tiny_model, tokens):
    """Tinker's top-K distillation: target_tokens and weights of shape (N, K)."""
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=6
    ).result()
    n, k = len(tokens), 3
    targets = np.array([[t + 1, t + 2, t + 3] for t in tokens], dtype=np.int64)
    weights = np.full((n, k), 0.25, dtype=np.float32)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(targets),
            "weights": types.TensorData.from_numpy(weights),
        },
    )
    out = trainer.forward([datum], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (n, k)
    for j in range(k):  # column j equals a plain forward with the j-th targets
        column = trainer.forward(
            [_datum(tokens, target_tokens=targets[:, j].tolist())], "cross_entropy"
        ).result()
        np.testing.assert_allclose(
            logprobs[:, j], column.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-5
        )
    assert out.metrics["loss:sum"] == pytest.approx(-(weights * logprobs).sum(), rel=1e-5)
    trainer.forward_backward([datum], "cross_entropy").result()  # and it trains
    assert math.isfinite(trainer.optim_step(ADAM).result().metrics["grad_norm:mean"])


def test_load_state_must_be_a_clients_first_request(service, tiny_model, tokens):
    """As on Tinker (and SkyRL): loading into a client that has done anything is a 400."""
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=7
    ).result()
    path = trainer.save_state("fresh").result().path
    message = _refused(lambda: trainer.load_state(path).result())
    assert "not permitted" in message and "create_training_client_from_state" in message
    trainer.forward_backward([_datum(tokens)], "cross_entropy").result()
    trainer.optim_step(ADAM).result()
    assert "not permitted" in _refused(lambda: trainer.load_state(path).result())
    restored = service.create_training_client_from_state(path).result()  # the way that works
    assert math.isfinite(_ce_loss(restored, tokens))


def test_a_retried_request_runs_once(server, service, tiny_model, tokens):
    """The SDK resends a request (same seq_id) after a dropped connection: it must get the
    original future, not apply the optimizer step twice."""
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=13
    ).result()
    trainer.forward_backward([_datum(tokens)], "cross_entropy").result()
    body = {"model_id": trainer.model_id, "adam_params": {"learning_rate": 0.01}, "seq_id": 100}
    first = _raw(server, "POST", "/api/v1/optim_step", json=body).json()
    again = _raw(server, "POST", "/api/v1/optim_step", json=body).json()
    assert again["request_id"] == first["request_id"]
    changed = {**body, "adam_params": {"learning_rate": 0.5}}
    conflict = _raw(server, "POST", "/api/v1/optim_step", json=changed)
    assert conflict.status_code == 409 and "reused" in conflict.json()["detail"]
    result = _raw(
        server, "POST", "/api/v1/retrieve_future", json={"request_id": first["request_id"]}
    ).json()
    assert result["metrics"]["grad_norm:mean"] > 0
    # Only one step ran: the next step has no gradient left to apply.
    fresh = {**body, "seq_id": 101}
    second = _raw(server, "POST", "/api/v1/optim_step", json=fresh).json()
    result = _raw(
        server, "POST", "/api/v1/retrieve_future", json={"request_id": second["request_id"]}
    ).json()
    assert result["metrics"]["grad_norm:mean"] == 0.0


def test_load_state_with_other_target_modules_changes_nothing(service, tiny_model, tokens):
    full = service.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=8).result()
    full.forward_backward([_datum(tokens)], "cross_entropy").result()
    full.optim_step(ADAM).result()
    path = full.save_state("full").result().path

    def attn_only():
        return service.create_lora_training_client(
            base_model=str(tiny_model), rank=4, seed=8, train_mlp=False, train_unembed=False
        ).result()

    before = _ce_loss(attn_only(), tokens)  # a twin: same seed, same initial weights
    client = attn_only()
    message = _refused(lambda: client.load_state_with_optimizer(path).result())
    assert "adapts" in message
    assert _ce_loss(client, tokens) == before


def test_a_bare_checkpoint_id_is_a_400_naming_the_form(server, service, tiny_model):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=9
    ).result()
    trainer.save_state("bare").result()
    base = f"/api/v1/training_runs/{trainer.model_id}/checkpoints/bare"
    for method, path in (
        ("DELETE", base),
        ("GET", base + "/archive"),
        ("POST", base + "/publish"),
        ("DELETE", base + "/publish"),
        ("PUT", base + "/ttl"),
    ):
        response = _raw(server, method, path, json={"ttl_seconds": 5})
        assert response.status_code == 400, (method, path, response.text)
        assert "weights/<name>" in response.json()["detail"]


def test_max_tokens_zero_gives_no_tokens_alone_and_batched(service, tiny_model, tokens):
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    prompt = types.ModelInput.from_ints(tokens)
    alone = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=0)).result()
    assert [len(s.tokens) for s in alone.sequences] == [0]
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(
                lambda m=m: sampler.sample(
                    prompt, 1, types.SamplingParams(max_tokens=m, seed=1)
                ).result()
            )
            for m in (0, 5, 0, 3)
        ]
        lengths = [len(f.result().sequences[0].tokens) for f in futures]
    assert lengths[0] == 0 and lengths[2] == 0
    assert 1 <= lengths[1] <= 5 and 1 <= lengths[3] <= 3


def test_max_tokens_above_the_server_cap_is_refused(server, service, tiny_model, tokens):
    caps = _raw(server, "GET", "/api/v1/get_server_capabilities").json()
    assert caps["max_sample_tokens"] == 16384
    assert caps["loss_fn_config"]["ppo"] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


# ---- errors stay with their request -----------------------------------------------------------


def test_a_huge_seed_fails_nobody_batched_with_it(service, tiny_model, tokens):
    """Before: a seed above ~9e12 overflowed and failed 11-12 of 12 concurrent requests."""
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    prompt = types.ModelInput.from_ints(tokens)
    seeds = [2**64 - 1, *range(11)]
    with cf.ThreadPoolExecutor(12) as pool:
        futures = [
            pool.submit(
                lambda s=s: sampler.sample(
                    prompt, 1, types.SamplingParams(max_tokens=4, seed=s)
                ).result()
            )
            for s in seeds
        ]
        results = [f.result() for f in futures]
    assert all(len(r.sequences[0].tokens) >= 1 for r in results)


# ---- weights and checkpoints -------------------------------------------------------------------


def _greedy_logprobs(sampler, prompt) -> list[float]:
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    return list(sampler.sample(prompt, 1, params).result().sequences[0].logprobs)


def test_resaving_a_sampler_name_serves_the_new_weights(service, tiny_model, tokens):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=10
    ).result()
    prompt = types.ModelInput.from_ints(tokens)
    path = trainer.save_weights_for_sampler("policy").result().path
    old = _greedy_logprobs(service.create_sampling_client(model_path=path).result(), prompt)
    for _ in range(3):
        trainer.forward_backward([_datum(tokens)], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert trainer.save_weights_for_sampler("policy").result().path == path
    fresh = _greedy_logprobs(trainer.save_weights_and_get_sampling_client().result(), prompt)
    served = _greedy_logprobs(service.create_sampling_client(model_path=path).result(), prompt)
    assert served == pytest.approx(fresh, abs=1e-5)
    assert served != pytest.approx(old, abs=1e-3)


def test_concurrent_saves_and_reads_of_one_name_always_find_a_whole_checkpoint(
    server, service, tiny_model, tokens
):
    """Before: rmtree-then-rename answered "no checkpoint at ..." 1-4 times in 120 calls."""
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=11
    ).result()
    path = trainer.save_weights_for_sampler("busy").result().path
    run, _, name = path.removeprefix("tinker://").split("/")
    rest = f"/api/v1/training_runs/{run}/checkpoints/sampler_weights/{name}"

    def read(i: int) -> int:
        if i % 2:
            return _raw(
                server, "POST", "/api/v1/weights_info", json={"tinker_path": path}
            ).status_code
        url = _raw(server, "GET", rest + "/archive").json()["url"]
        return httpx.get(url, timeout=30).status_code

    with cf.ThreadPoolExecutor(8) as pool:
        saves = [
            pool.submit(lambda: trainer.save_weights_for_sampler("busy").result())
            for _ in range(10)
        ]
        codes = list(pool.map(read, range(30)))
        for s in saves:
            assert s.result().path == path
    assert codes == [200] * 30


def test_checkpoint_ttl_publish_and_unpublish(server, service, tiny_model):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=12
    ).result()
    short = trainer.save_state("short", ttl_seconds=1).result().path
    kept = trainer.save_state("kept").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-dummy")
    rest.publish_checkpoint_from_tinker_path(kept).result()
    rest.publish_checkpoint_from_tinker_path(kept).result(timeout=30)  # idempotent, not a 409
    listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert {c.tinker_path: c.public for c in listed}[kept] is True
    rest.unpublish_checkpoint_from_tinker_path(kept).result()
    rest.unpublish_checkpoint_from_tinker_path(kept).result(timeout=30)
    rest.set_checkpoint_ttl_from_tinker_path(kept, 3600).result()
    time.sleep(1.5)
    listed = {
        c.tinker_path: c for c in rest.list_checkpoints(trainer.model_id).result().checkpoints
    }
    assert short not in listed  # expired: gone from listings
    assert listed[kept].public is False and listed[kept].expires_at is not None
    response = _raw(server, "POST", "/api/v1/weights_info", json={"tinker_path": short})
    assert response.status_code == 404


def test_runs_and_sessions_list_newest_first_with_paging(server, service, tiny_model):
    newest = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=14
    ).result()
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-dummy")
    runs = rest.list_training_runs(limit=2).result()
    assert runs.training_runs[0].training_run_id == newest.model_id
    assert len(runs.training_runs) <= 2
    sessions = rest.list_sessions(limit=1).result().sessions
    assert len(sessions) == 1

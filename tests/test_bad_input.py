"""Bad input answers 4xx with the field named, through the unmodified SDK, and the server keeps
serving afterwards."""

from __future__ import annotations

import math

import httpx
import pytest
import tinker
from tinker import types

from rlcli.launch import process


@pytest.fixture(scope="module")
def trainer(service, tiny_model):
    return service.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=0).result()


def _datum(tokens=(5, 6, 7, 8), **inputs) -> types.Datum:
    n = len(tokens)
    loss_fn_inputs = {"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * n}
    loss_fn_inputs.update(inputs)
    loss_fn_inputs = {k: v for k, v in loss_fn_inputs.items() if v is not None}
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens)), loss_fn_inputs=loss_fn_inputs
    )


def _rl_datum(**overrides) -> types.Datum:
    inputs = {"weights": None, "logprobs": [-1.0] * 4, "advantages": [1.0] * 4}
    inputs.update(overrides)
    return _datum(**inputs)


def _assert_still_serves(server, trainer) -> None:
    healthy, detail = process.health(server.base_url)
    assert healthy, detail
    result = trainer.forward([_datum()], "cross_entropy").result()
    assert math.isfinite(result.metrics["loss:sum"])


CASES = [
    pytest.param(
        lambda: ([_datum()], "no_such_loss", None),
        tinker.UnprocessableEntityError,
        ["unknown loss 'no_such_loss'", "supported:", "gspo", "cross_entropy"],
        id="unknown-loss",
    ),
    pytest.param(
        lambda: ([_datum(tokens=(5, 6, 99999, 8))], "cross_entropy", None),
        tinker.UnprocessableEntityError,
        ["data[0].model_input[2]", "99999", "outside the vocabulary"],
        id="token-id-outside-vocab",
    ),
    pytest.param(
        lambda: ([_datum(), _datum(target_tokens=[1, 2, 3, -4])], "cross_entropy", None),
        tinker.UnprocessableEntityError,
        ["data[1].loss_fn_inputs.target_tokens[3]", "-4"],
        id="target-token-outside-vocab",
    ),
    pytest.param(
        lambda: ([_datum(weights=[1.0, 1.0, 1.0])], "cross_entropy", None),
        tinker.UnprocessableEntityError,
        ["data[0].loss_fn_inputs.weights", "shape [3], expected [4]"],
        id="wrong-shape",
    ),
    pytest.param(
        lambda: ([_rl_datum(advantages=None)], "ppo", None),
        tinker.UnprocessableEntityError,
        ["data[0].loss_fn_inputs.advantages: missing", "'ppo'"],
        id="missing-loss-input",
    ),
    pytest.param(
        lambda: (
            [_rl_datum(advantages=[1.0, float("nan"), 1.0, 1.0])],
            "importance_sampling",
            None,
        ),
        tinker.UnprocessableEntityError,
        ["data[0].loss_fn_inputs.advantages", "NaN"],
        id="nan-advantage",
    ),
    pytest.param(
        lambda: ([_rl_datum()], "ppo", {"clip_epsilon": 0.2}),
        tinker.UnprocessableEntityError,
        ["loss_fn_config", "clip_epsilon", "clip_high_threshold"],
        id="unknown-loss-config-key",
    ),
]


@pytest.mark.parametrize(("make", "error", "fragments"), CASES)
def test_bad_forward_backward_answers_4xx_naming_the_field(server, trainer, make, error, fragments):
    data, loss_fn, config = make()
    with pytest.raises(error) as excinfo:
        trainer.forward_backward(data, loss_fn, config).result()
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, message
    _assert_still_serves(server, trainer)


def test_unknown_model_id_answers_404(server, service, trainer):
    ghost = tinker.TrainingClient(
        service.holder, model_seq_id=999, model_id="no-such-model", info=trainer.get_info()
    )
    with pytest.raises(tinker.NotFoundError, match="model_id: unknown model 'no-such-model'"):
        ghost.forward_backward([_datum()], "cross_entropy").result()
    with pytest.raises(tinker.NotFoundError, match="no-such-model"):
        ghost.optim_step(types.AdamParams()).result()
    _assert_still_serves(server, trainer)


def test_lora_rank_above_the_server_limit_is_refused(server, service, tiny_model, trainer):
    with pytest.raises(tinker.BadRequestError, match=r"lora_config.rank: 1000 is outside 1\.\.64"):
        service.create_lora_training_client(base_model=str(tiny_model), rank=1000).result()
    _assert_still_serves(server, trainer)


def test_base_model_not_served_is_refused(server, service, trainer):
    with pytest.raises(tinker.BadRequestError, match="base_model: 'Qwen/Qwen3-8B' is not served"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    _assert_still_serves(server, trainer)


def test_api_key_is_enforced_when_set(keyed_server, tiny_model):
    _, record = keyed_server
    wrong = tinker.ServiceClient(base_url=record.base_url, api_key="tml-wrong")
    with pytest.raises(tinker.PermissionDeniedError, match="X-API-Key: wrong"):
        wrong.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    missing = httpx.post(record.base_url + "/api/v1/create_session", json={}, timeout=10)
    assert missing.status_code == 401 and "missing" in missing.json()["detail"]
    good = tinker.ServiceClient(base_url=record.base_url, api_key="tml-secret")
    trainer = good.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    assert trainer.forward([_datum()], "cross_entropy").result().metrics["loss:sum"] > 0

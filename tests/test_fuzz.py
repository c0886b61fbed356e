"""Hostile requests across every endpoint: each is answered with a 4xx (never a 5xx, a hang or
a dropped connection), and afterwards the server is healthy and its adapters are finite.

Every case is raw HTTP on a keep-alive connection (as the SDK uses), so a dropped connection
shows up as a transport error in the next request."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
from tinker import types

from rlcli.compat.pins import public_pb
from rlcli.server import wire

JSON = {"content-type": "application/json"}
PROTO = {"content-type": wire.PROTO_CONTENT_TYPE}


def _fb(model_id: str, tokens=(5, 6, 7), tensors: dict | None = None, **fields) -> bytes:
    """A ForwardBackwardRequest protobuf; ``tensors`` maps input names to Tensor messages."""
    fields.setdefault("loss_fn", "cross_entropy")
    msg = public_pb.ForwardBackwardRequest(model_id=model_id, **fields)
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    for name, tensor in (tensors or {}).items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    return msg.SerializeToString()


def _dense(values, dtype=np.int64, shape=None) -> public_pb.Tensor:
    arr = np.asarray(values, dtype=dtype)
    kind = {np.int64: public_pb.DTYPE_INT64, np.float32: public_pb.DTYPE_FLOAT32}[dtype]
    return public_pb.Tensor(
        dense=arr.tobytes(), dtype=kind, shape=list(arr.shape if shape is None else shape)
    )


def _cases(session_id: str, model_id: str) -> list[tuple[str, str, dict]]:
    """(method, path, httpx kwargs): every one is malformed or hostile."""
    good_targets = _dense([6, 7, 8])
    post = "POST"
    c: list[tuple[str, str, dict]] = [
        # handshake and sessions
        (post, "/api/v1/create_session", {"json": {"tags": 5, "sdk_version": "x"}}),
        (post, "/api/v1/create_session", {"json": [1, 2]}),
        (post, "/api/v1/create_session", {"content": b"{not json", "headers": JSON}),
        (post, "/api/v1/session_heartbeat", {"json": {"session_id": 12}}),
        (post, "/api/v1/session_heartbeat", {"json": {"session_id": "nope"}}),
        # models
        (post, "/api/v1/create_model", {"json": {"session_id": session_id, "base_model": 3}}),
        (
            post,
            "/api/v1/create_model",
            {"json": {"session_id": session_id, "base_model": "x", "lora_config": "ab"}},
        ),
        (
            post,
            "/api/v1/create_model",
            {"json": {"session_id": session_id, "base_model": "x", "user_metadata": "x"}},
        ),
        (
            post,
            "/api/v1/create_model",
            {
                "json": {
                    "session_id": session_id,
                    "base_model": "x",
                    "lora_config": {"rank": 1, "seed": "abc"},
                }
            },
        ),
        (
            post,
            "/api/v1/create_model",
            {"json": {"session_id": session_id, "base_model": "x", "lora_config": {"rank": -3}}},
        ),
        (post, "/api/v1/get_info", {"json": {"model_id": None}}),
        (post, "/api/v1/unload_model", {"json": {"model_id": "no-such-model"}}),
        # forward_backward bodies
        (post, "/api/v1/forward_backward", {"content": b"\x00\xffgarbage", "headers": PROTO}),
        (
            post,
            "/api/v1/forward_backward",
            {"content": b"garbage", "headers": {**PROTO, "content-encoding": "zstd"}},
        ),
        (
            post,
            "/api/v1/forward_backward",
            {"content": b"x", "headers": {**PROTO, "content-encoding": "br"}},
        ),
        (post, "/api/v1/forward_backward", {"content": b"{}", "headers": JSON}),
        (
            post,
            "/api/v1/forward_backward",
            {
                "content": _fb(
                    model_id,
                    tensors={
                        "target_tokens": good_targets,
                        "weights": public_pb.Tensor(
                            dtype=public_pb.DTYPE_FLOAT32,
                            shape=[1, 3],
                            sparse_csr=public_pb.SparseCsr(
                                values=np.ones(1, np.float32).tobytes(),
                                crow_indices=np.asarray([0, 1], np.int64).tobytes(),
                                col_indices=np.asarray([7], np.int64).tobytes(),
                            ),
                        ),
                    },
                ),
                "headers": PROTO,
            },
        ),
        (
            post,
            "/api/v1/forward_backward",
            {
                "content": _fb(
                    model_id,
                    tensors={"target_tokens": _dense([1], shape=[2**32, 2**32])},
                ),
                "headers": PROTO,
            },
        ),
        (
            post,
            "/api/v1/forward_backward",
            {
                "content": _fb(model_id, tensors={"target_tokens": _dense([6, 7, 8, 9])}),
                "headers": PROTO,
            },
        ),
        (
            post,
            "/api/v1/forward_backward",
            {
                "content": _fb(model_id, tensors={"target_tokens": _dense([6, 7, 2**40])}),
                "headers": PROTO,
            },
        ),
        (
            post,
            "/api/v1/forward_backward",
            {
                "content": _fb(
                    model_id,
                    tensors={
                        "target_tokens": good_targets,
                        "weights": _dense([1, float("inf"), 1], dtype=np.float32),
                    },
                ),
                "headers": PROTO,
            },
        ),
        (
            post,
            "/api/v1/forward_backward",
            {
                "content": _fb(model_id, tensors={"target_tokens": good_targets}, loss_fn="nope"),
                "headers": PROTO,
            },
        ),
        (
            post,
            "/api/v1/forward_backward",
            {
                "content": _fb("no-such-model", tensors={"target_tokens": good_targets}),
                "headers": PROTO,
            },
        ),
        (
            post,
            "/api/v1/forward_backward",
            {
                "content": _fb(model_id, tokens=(), tensors={"target_tokens": _dense([])}),
                "headers": PROTO,
            },
        ),
        # optim_step
        (
            post,
            "/api/v1/optim_step",
            {"json": {"model_id": model_id, "adam_params": {"beta2": 2.0}}},
        ),
        (post, "/api/v1/optim_step", {"json": {"model_id": model_id, "adam_params": "fast"}}),
        (
            post,
            "/api/v1/optim_step",
            {
                "content": f'{{"model_id": "{model_id}", "adam_params": {{"learning_rate": NaN}}}}',
                "headers": JSON,
            },
        ),
        # sampling
        (
            post,
            "/api/v1/asample",
            {"json": {"prompt": {"chunks": [{"tokens": [10**20]}]}, "base_model": "x"}},
        ),
        (
            post,
            "/api/v1/asample",
            {
                "json": {
                    "prompt": {"chunks": [{"tokens": [5]}]},
                    "sampling_params": {"temperature": "abc"},
                }
            },
        ),
        (
            post,
            "/api/v1/asample",
            {"json": {"prompt": {"chunks": [{"tokens": [5]}]}, "sampling_params": {"top_k": None}}},
        ),
        (
            post,
            "/api/v1/asample",
            {
                "json": {
                    "prompt": {"chunks": [{"tokens": [5]}]},
                    "sampling_params": {"top_k": 10**30},
                }
            },
        ),
        (
            post,
            "/api/v1/asample",
            {"json": {"prompt": {"chunks": [{"tokens": [5]}]}, "sampling_params": "x"}},
        ),
        (
            post,
            "/api/v1/asample",
            {"json": {"prompt": {"chunks": [{"tokens": [5]}]}, "sampling_params": {"seed": "abc"}}},
        ),
        (
            post,
            "/api/v1/asample",
            {"json": {"prompt": {"chunks": [{"tokens": [5]}]}, "sampling_params": {"seed": -1}}},
        ),
        (
            post,
            "/api/v1/asample",
            {"json": {"prompt": {"chunks": [{"tokens": [5]}]}, "num_samples": 0}},
        ),
        (post, "/api/v1/asample", {"json": {"prompt": "hello"}}),
        (post, "/api/v1/asample", {"json": {"prompt": {"chunks": []}, "base_model": "x"}}),
        (
            post,
            "/api/v1/asample",
            {"json": {"prompt": {"chunks": [{"tokens": [5]}]}, "sampling_session_id": "nope"}},
        ),
        (
            post,
            "/api/v1/create_sampling_session",
            {"json": {"session_id": session_id, "model_path": "tinker://../x"}},
        ),
        # futures
        (post, "/api/v1/retrieve_future", {"content": b"{oops", "headers": JSON}),
        (post, "/api/v1/retrieve_future", {"json": [1, 2, 3]}),
        (post, "/api/v1/retrieve_future", {"json": {"request_id": "nope"}}),
        # checkpoints and REST
        (
            post,
            "/api/v1/save_weights",
            {"json": {"model_id": model_id, "path": "a", "ttl_seconds": "abc"}},
        ),
        (post, "/api/v1/save_weights", {"json": {"model_id": model_id, "path": "../../etc"}}),
        (
            post,
            "/api/v1/save_weights_for_sampler",
            {"json": {"model_id": model_id, "path": ".hidden"}},
        ),
        (
            post,
            "/api/v1/load_weights",
            {"json": {"model_id": model_id, "path": "tinker://x/weights/none"}},
        ),
        (post, "/api/v1/load_weights", {"json": {"model_id": model_id, "path": "s3://bucket"}}),
        (post, "/api/v1/weights_info", {"json": {"tinker_path": 5}}),
        ("GET", "/api/v1/training_runs/..%2F..", {}),
        ("GET", "/api/v1/training_runs/nope/checkpoints", {}),
        ("DELETE", f"/api/v1/training_runs/{model_id}/checkpoints/nope", {}),
        ("DELETE", f"/api/v1/training_runs/{model_id}/checkpoints/weights/nope", {}),
        (
            "PUT",
            f"/api/v1/training_runs/{model_id}/checkpoints/weights/nope/ttl",
            {"json": {"ttl_seconds": "x"}},
        ),
        ("POST", f"/api/v1/training_runs/{model_id}/checkpoints/bogus/x/publish", {}),
        ("GET", "/rlcli/archives/forged-token.tar", {}),
    ]
    return c


def test_hostile_requests_get_4xx_and_the_server_stays_healthy(server, service, tiny_model):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=0
    ).result()
    session_id = service.holder.get_session_id()
    cases = _cases(session_id, trainer.model_id)
    assert len(cases) >= 40
    answers = []
    with httpx.Client(
        base_url=server.base_url, headers={"X-API-Key": "tml-dummy"}, timeout=30
    ) as http:
        for method, path, kwargs in cases:
            response = http.request(method, path, **kwargs)
            answers.append((method, path, response.status_code, response.text[:200]))
        assert http.get("/api/v1/healthz").status_code == 200  # same connection still works
    bad = [a for a in answers if not 400 <= a[2] < 500]
    assert not bad, bad
    # Every 400 names what was wrong in one line.
    assert all(a[3] and "\n" not in a[3] for a in answers)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8]},
    )
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    loss = trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert math.isfinite(loss)


@pytest.mark.parametrize("accept", ["application/json", wire.PROTO_CONTENT_TYPE])
def test_forward_results_encode_in_both_formats(server, service, tiny_model, accept):
    """The JSON result path is the one clients without protobuf use; both answer."""
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=0
    ).result()
    body = _fb(trainer.model_id, tensors={"target_tokens": _dense([6, 7, 8])}, forward_only=True)
    headers = {"X-API-Key": "tml-dummy"}
    future = httpx.post(
        server.base_url + "/api/v1/forward_backward",
        content=body,
        headers={**headers, **PROTO},
        timeout=30,
    ).json()
    result = httpx.post(
        server.base_url + "/api/v1/retrieve_future",
        json={"request_id": future["request_id"]},
        headers={**headers, "accept": accept},
        timeout=60,
    )
    assert result.status_code == 200
    assert result.headers["content-type"].startswith(accept)

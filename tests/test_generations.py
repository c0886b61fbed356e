"""Both SDK generations on one server (``server/http/tinker/generations.py``): a 0.25 client
(its own venv) and a 0.38 client (rlcli's) drive the same server at once through the whole
journey and the cookbook's own training loops; the 0.38-only features work through the SDK;
what a session of the other generation may not send, or what is not implemented, is a 4xx
naming the field and changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

HEADERS = {"X-API-Key": "tml-dummy"}


def _journey(python: str, base_url: str, model: Path, out: Path) -> subprocess.Popen:
    script = Path(__file__).with_name("sdk_client.py")
    return subprocess.Popen(
        [python, str(script), base_url, str(model), str(out), "--cookbook"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_both_generations_drive_one_server_at_once(server, tiny_model, old_sdk_python, tmp_path):
    runs = {}
    for name, python in (("0.25", old_sdk_python), ("0.38", sys.executable)):
        (tmp_path / name).mkdir()
        out = tmp_path / name / "out.json"
        runs[name] = (_journey(python, server.base_url, tiny_model, out), out)
    seen = {}
    for name, (proc, out) in runs.items():
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"tinker {name}:\n{log[-4000:]}"
        seen[name] = json.loads(out.read_text())
    old, new = seen["0.25"], seen["0.38"]
    assert (old["tinker"], new["tinker"]) == ("0.25.0", "0.38.0")
    for result in (old, new):
        assert result["losses"][-1] < result["losses"][0]  # training works for both
        assert len(result["samples"]) == 3 and all(len(s) == 6 for s in result["samples"])
        assert result["prompt_logprobs"][0] is None and len(result["prompt_logprobs"]) == 20
        assert result["restore_max_diff"] < 1e-5  # a state restored with its optimizer
        assert result["sl_steps"] >= 1 and result["rl_steps"] == 2  # the cookbook's loops
    # 0.38: one id per sample, unique; its restored client has the id it derived itself.
    assert len(set(new["sequence_ids"])) == 3 and None not in new["sequence_ids"]
    assert new["restored_model_id"].split(":")[1:] == ["train", "1"]
    assert new["closed"]
    # The 0.38 session is finished: its training client answers 410; 0.25's lives on.
    finished = httpx.post(
        f"{server.base_url}/api/v1/get_info", json={"model_id": new["model_id"]}, headers=HEADERS
    )
    assert finished.status_code == 410, finished.text
    alive = httpx.post(
        f"{server.base_url}/api/v1/get_info", json={"model_id": old["model_id"]}, headers=HEADERS
    )
    assert alive.status_code == 200


@pytest.fixture(scope="module")
def sampler(service, tiny_model):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=21
    ).result()
    return trainer.save_weights_and_get_sampling_client().result()


PROMPT = list(range(30, 42))


def test_top_k_logprobs_of_sampled_tokens(sampler):
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)
    response = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 2, params, topk_sample_logprobs=4
    ).result()
    for seq in response.sequences:
        top = seq.topk_logprobs_np
        assert top.token_ids.shape == (len(seq.tokens), 4)
        # Sorted, and the sampled token's logprob is within them or below the 4th.
        assert np.all(np.diff(top.logprobs, axis=1) <= 0)
        for t, token in enumerate(seq.tokens):
            if token in top.token_ids[t]:
                k = list(top.token_ids[t]).index(token)
                assert abs(top.logprobs[t, k] - seq.logprobs[t]) < 1e-4
            else:
                assert seq.logprobs[t] <= top.logprobs[t, -1] + 1e-4


def test_prompt_scoring_options_agree_with_full_prompt_logprobs(sampler):
    prompt = types.ModelInput.from_ints(PROMPT)
    full = sampler.compute_logprobs(prompt).result()
    last = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
    assert last[:-3] == [None] * (len(PROMPT) - 3)
    np.testing.assert_allclose(last[-3:], full[-3:], atol=1e-5)
    # With top-k too (a teacher scoring an answer): the prefill keeps logits for the last 3
    # positions only; their top-k agree with the full prompt's, the rows before are empty.
    scored = types.SamplingParams(max_tokens=1, temperature=0.0)
    every, tail = (
        sampler.sample(prompt, 1, scored, include_prompt_logprobs=True, topk_prompt_logprobs=4,
                       **extra).result()
        for extra in ({}, {"prompt_logprobs_last_n": 3})
    )  # fmt: skip
    np.testing.assert_allclose(tail.prompt_logprobs[-3:], every.prompt_logprobs[-3:], atol=1e-5)
    for got, want in zip(tail.topk_prompt_logprobs[-3:], every.topk_prompt_logprobs[-3:],
                         strict=True):  # fmt: skip
        assert [t for t, _ in got] == [t for t, _ in want]
        np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], atol=1e-5)
    assert not any(tail.topk_prompt_logprobs[1:-3])  # nothing where nothing was scored

    # target_prompt_logprobs: column 0 asks for the prompt's own next token (= prompt
    # logprobs), column 1 for token 0; -1 asks for nothing and gets 0.0.
    n = len(PROMPT)
    targets = np.full((n - 1, 2), -1, dtype=np.int64)
    targets[:, 0] = PROMPT[1:]
    targets[::2, 1] = 0
    params = types.SamplingParams(max_tokens=0)
    dense = sampler.sample(
        prompt, 1, params, target_prompt_logprobs=types.TensorData.from_numpy(targets)
    ).result()
    got = np.asarray(dense.target_prompt_logprobs.data, dtype=np.float32).reshape(n - 1, 2)
    np.testing.assert_allclose(got[:, 0], full[1:], atol=1e-5)
    assert np.all(got[1::2, 1] == 0.0) and np.all(got[::2, 1] < 0)

    # Alternative draws at each prompt position: k per position, with their logprobs.
    alt = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=0, seed=5), prompt_alt_tokens_k=3
    ).result()
    tokens = np.asarray(alt.prompt_alt_tokens.tokens.data).reshape(n - 1, 3)
    logprobs = np.asarray(alt.prompt_alt_tokens.logprobs.data).reshape(n - 1, 3)
    assert tokens.min() >= 0 and np.all(logprobs <= 0)


def test_stop_list_empty_means_no_stop_for_038_and_eos_for_025(server, service, tiny_model):
    """tinker 0.38 documents ``stop=[]`` as "no stop, not even EOS"; 0.25 stopped at EOS. A
    LoRA taught to answer EOS at once shows which one a session gets."""
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=3
    ).result()
    eos = trainer.get_tokenizer().eos_token_id
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT),
        loss_fn_inputs={
            "target_tokens": [*PROMPT[1:], eos],
            "weights": [0.0] * (len(PROMPT) - 1) + [1.0],
        },
    )
    for _ in range(20):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = trainer.save_weights_for_sampler("eos").result().path
    answers = {}
    for version in ("0.25.0", "0.38.0"):
        session = httpx.post(
            f"{server.base_url}/api/v1/create_session",
            json={"tags": [], "sdk_version": version},
            headers=HEADERS,
        ).json()["session_id"]
        sampler = httpx.post(
            f"{server.base_url}/api/v1/create_sampling_session",
            json={"session_id": session, "model_path": path},
            headers=HEADERS,
        ).json()["sampling_session_id"]
        for stop in (None, []):
            body = {
                "sampling_session_id": sampler,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                "sampling_params": {"max_tokens": 5, "temperature": 0.0, "stop": stop},
            }
            seq = _sample_json(server.base_url, body)["sequences"][0]
            answers[version, str(stop)] = (seq["stop_reason"], seq["tokens"][0] == eos)
    assert answers == {
        ("0.25.0", "None"): ("stop", True),
        ("0.25.0", "[]"): ("stop", True),
        ("0.38.0", "None"): ("stop", True),
        ("0.38.0", "[]"): ("length", True),
    }


def _sample_json(base_url: str, body: dict) -> dict:
    future = httpx.post(f"{base_url}/api/v1/asample", json=body, headers=HEADERS)
    assert future.status_code == 200, future.text
    for _ in range(100):
        result = httpx.post(
            f"{base_url}/api/v1/retrieve_future",
            json={"request_id": future.json()["request_id"]},
            headers=HEADERS,
            timeout=60,
        ).json()
        if result.get("type") != "try_again":
            return result
    raise AssertionError("no result")


def _legacy_sampling_session(base_url: str, model: str) -> str:
    session = httpx.post(
        f"{base_url}/api/v1/create_session",
        json={"tags": [], "sdk_version": "0.25.0"},
        headers=HEADERS,
    ).json()["session_id"]
    return httpx.post(
        f"{base_url}/api/v1/create_sampling_session",
        json={"session_id": session, "base_model": model},
        headers=HEADERS,
    ).json()["sampling_session_id"]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"topk_sample_logprobs": 2}, "topk_sample_logprobs: needs a tinker>=0.38 client"),
        ({"prompt_alt_tokens_k": 1}, "prompt_alt_tokens_k: needs a tinker>=0.38 client"),
    ],
)
def test_a_038_field_from_a_025_session_is_refused(server, tiny_model, extra, fragment):
    body = {
        "sampling_session_id": _legacy_sampling_session(server.base_url, str(tiny_model)),
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 2},
        **extra,
    }
    answer = httpx.post(f"{server.base_url}/api/v1/asample", json=body, headers=HEADERS)
    assert answer.status_code in (400, 422) and fragment in answer.text, answer.text


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (
            {"prompt_logprobs": True, "prompt_logprobs_last_n": 50},
            "prompt_logprobs_last_n: 50 is more than the 11 prompt tokens",
        ),
        ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n: needs prompt_logprobs=true"),
        ({"record_stability_info": True}, "record_stability_info:"),
        (
            {"target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [1, 2]}},
            "target_prompt_logprobs.shape: [1, 2] is not [len(prompt) - 1, K] = [11, K]",
        ),
    ],
)
def test_bad_038_sample_fields_are_400s_naming_the_field(server, tiny_model, extra, fragment):
    body = {
        "base_model": str(tiny_model),
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 2},
        **extra,
    }
    answer = httpx.post(f"{server.base_url}/api/v1/asample", json=body, headers=HEADERS)
    assert answer.status_code in (400, 422) and fragment in answer.text, answer.text


def test_unimplemented_038_features_are_refused_with_what_to_use(service, tiny_model):
    with pytest.raises(tinker.BadRequestError, match="optimizer_config.type: 'dimuon'"):
        service.create_lora_training_client(
            base_model=str(tiny_model), rank=4, optimizer=types.DimuonOptimizerConfig()
        ).result()
    trainer = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={
            "target_tokens": PROMPT[1:],
            "logprobs": [-1.0] * (len(PROMPT) - 1),
            "advantages": [1.0] * (len(PROMPT) - 1),
        },
    )
    with pytest.raises(Exception, match="stable_reinforce.*importance_sampling or ppo"):
        trainer.forward_backward([datum], "stable_reinforce").result()
    with pytest.raises(Exception, match="age_encryption_recipients"):
        trainer.save_weights_external("secret", age_encryption_recipients=["age1xyz"]).result()
    # Nothing changed: the client still trains.
    trainer.forward_backward([datum], "importance_sampling").result()


def test_spans_that_do_not_tile_their_datum_are_refused(server, service, tiny_model):
    from rlcli.server.wire import public_pb

    trainer = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    msg = public_pb.ForwardBackwardRequest(model_id=trainer.model_id, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(PROMPT, np.int32).tobytes()
    for name, values in (("target_tokens", PROMPT), ("weights", [1.0] * len(PROMPT))):
        tensor = datum.loss_fn_inputs[name]
        dtype = np.int64 if name == "target_tokens" else np.float32
        tensor.dtype = public_pb.DTYPE_INT64 if dtype is np.int64 else public_pb.DTYPE_FLOAT32
        tensor.shape.append(len(values))
        tensor.dense = np.asarray(values, dtype).tobytes()
    datum.model_input_spans.add().sampled_tokens.length = len(PROMPT) - 1  # one short
    datum.model_input_spans[0].sampled_tokens.sequence_id = "s:0"
    datum.loss_fn_input_spans.add().sampled_tokens.length = len(PROMPT)
    datum.loss_fn_input_spans[0].sampled_tokens.sequence_id = "s:0"
    answer = httpx.post(
        f"{server.base_url}/api/v1/forward_backward",
        content=msg.SerializeToString(),
        headers={**HEADERS, "content-type": "application/x-protobuf"},
    )
    assert answer.status_code == 422, answer.text  # as every other bad payload
    assert "data[0].model_input_spans: the runs cover 11 positions" in answer.text
    assert httpx.get(f"{server.base_url}/api/v1/healthz").status_code == 200


def test_a_025_client_never_lists_an_external_checkpoint(server, service, tiny_model):
    """0.25's strict models reject the checkpoint type ``external``: its listings leave those
    out (told apart by the SDK version header every generation sends); 0.38 sees them."""
    trainer = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    trainer.save_state("kept").result()
    external = trainer.save_weights_external("export").result().path
    assert external.endswith("/external_weights/export")
    route = f"{server.base_url}/api/v1/training_runs/{trainer.model_id}/checkpoints"
    types_seen = {}
    for version in ("0.25.0", "0.38.0"):
        headers = {**HEADERS, "X-Stainless-Package-Version": version}
        listed = httpx.get(route, headers=headers).json()["checkpoints"]
        types_seen[version] = sorted(c["checkpoint_type"] for c in listed)
        everything = httpx.get(f"{server.base_url}/api/v1/checkpoints", headers=headers).json()
        if version == "0.25.0":
            assert "external" not in {c["checkpoint_type"] for c in everything["checkpoints"]}
    assert types_seen == {"0.25.0": ["training"], "0.38.0": ["external", "training"]}

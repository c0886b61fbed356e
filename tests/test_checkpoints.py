"""Checkpoints through the SDK and the official `tinker` CLI: exact state round trips, sampler
checkpoints that survive a restart, and downloads that peft loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from conftest import start_server
from rlcli.launch import process

ADAM = types.AdamParams(learning_rate=5e-3, weight_decay=0.01)


def _data(tokenizer) -> list[types.Datum]:
    out = []
    for text in ("What is 1 + 1? The answer is 2.", "Say hello. hello world"):
        ids = tokenizer.encode(text)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return out


def _step(trainer, data) -> None:
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(ADAM).result()


def _loss(trainer, data) -> float:
    return trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]


def _logprobs(trainer, data) -> list[np.ndarray]:
    out = trainer.forward(data, "cross_entropy").result().loss_fn_outputs
    return [np.asarray(o["logprobs"].data) for o in out]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt-home")


@pytest.fixture(scope="module")
def restartable(home, tiny_model):
    """A server whose checkpoints live in ``home``; tests may restart it."""
    record = start_server(home, tiny_model)
    yield record
    process.stop(home)


def test_restored_state_continues_exactly_as_if_never_stopped(restartable, tiny_model):
    service = tinker.ServiceClient(base_url=restartable.base_url, api_key="tml-dummy")
    original = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=0
    ).result()
    data = _data(original.get_tokenizer())
    for _ in range(2):
        _step(original, data)
    saved = original.save_state("mid").result()
    assert saved.path == f"tinker://{original.model_id}/weights/mid"
    at_save = _logprobs(original, data)
    _step(original, data)
    continued = _loss(original, data)

    resumed = service.create_training_client_from_state_with_optimizer(saved.path).result()
    for a, b in zip(_logprobs(resumed, data), at_save, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    _step(resumed, data)
    assert _loss(resumed, data) == pytest.approx(continued, rel=1e-5)

    # Weights only: same starting point, fresh Adam moments, so the next step differs.
    weights_only = service.create_training_client_from_state(saved.path).result()
    for a, b in zip(_logprobs(weights_only, data), at_save, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    _step(weights_only, data)
    assert _loss(weights_only, data) != pytest.approx(continued, rel=1e-5)


def test_sampler_checkpoint_survives_a_server_restart(home, restartable, tiny_model):
    service = tinker.ServiceClient(base_url=restartable.base_url, api_key="tml-dummy")
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=1
    ).result()
    tokenizer = trainer.get_tokenizer()
    _step(trainer, _data(tokenizer))
    path = trainer.save_weights_for_sampler("survivor").result().path
    prompt = types.ModelInput.from_ints(tokenizer.encode("What is 1 + 1?"))
    params = types.SamplingParams(max_tokens=12, seed=42)
    before = (
        service.create_sampling_client(model_path=path).result().sample(prompt, 2, params).result()
    )

    process.stop(home)
    record = start_server(home, tiny_model)
    again = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
    after = (
        again.create_sampling_client(model_path=path).result().sample(prompt, 2, params).result()
    )
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    np.testing.assert_allclose(after.sequences[0].logprobs, before.sequences[0].logprobs, atol=1e-5)
    # The run and its checkpoint are still listed after the restart.
    rest = tinker.RestClient(base_url=record.base_url, api_key="tml-dummy")
    runs = rest.list_training_runs().result()
    assert trainer.model_id in [r.training_run_id for r in runs.training_runs]


def _tinker_cli(
    base_url: str, *args: str, via_rlcli: bool = False, python: str = sys.executable
) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_API_KEY": "tml-dummy"}
    if via_rlcli:  # the flag must win over a stale TINKER_BASE_URL
        env["TINKER_BASE_URL"] = "http://127.0.0.1:9"
        group, *rest = args
        command = [sys.executable, "-m", "rlcli.cli.main", group, "--base-url", base_url, *rest]
    else:
        env["TINKER_BASE_URL"] = base_url
        command = [python, "-m", "tinker.cli", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.parametrize("cli", ["tinker", "tinker-0.25", "rlcli"])
def test_official_cli_lists_and_downloads_a_peft_loadable_adapter(
    tmp_path, home, restartable, tiny_model, cli, request
):
    """Each SDK generation's ``tinker checkpoint download`` of a training state: 0.25 fetches
    the archive; 0.38 makes a training client from the state, exports it as external weights,
    fetches their files and deletes the export. Both give a PEFT adapter that loads."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    via_rlcli = cli == "rlcli"
    python = request.getfixturevalue("old_sdk_python") if cli == "tinker-0.25" else sys.executable
    record = process.read_record(home)  # the restart test may have replaced the server
    service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=2
    ).result()
    data = _data(trainer.get_tokenizer())
    for _ in range(2):
        _step(trainer, data)
    path = trainer.save_state("export").result().path
    expected = _logprobs(trainer, data)

    def tinker_cli(*args):
        return _tinker_cli(record.base_url, *args, via_rlcli=via_rlcli, python=python)

    if via_rlcli:
        runs = json.loads(tinker_cli("run", "list", "--json").stdout)
        listed = json.loads(tinker_cli("checkpoint", "-f", "json", "list").stdout)
    else:
        runs = json.loads(tinker_cli("-f", "json", "run", "list").stdout)
        listed = json.loads(tinker_cli("-f", "json", "checkpoint", "list").stdout)
    assert trainer.model_id in [r["training_run_id"] for r in runs["runs"]]
    assert path in [c["tinker_path"] for c in listed["checkpoints"]]

    info_args = ("checkpoint", "info", path)
    if not via_rlcli:
        info_args = ("-f", "json", *info_args)
    assert "weights/export" in tinker_cli(*info_args).stdout
    tinker_cli("checkpoint", "download", path, "-o", str(tmp_path))
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (folder / "adapter_model.safetensors").exists()
    # 0.38's temporary export is gone again: only the state is left in the run.
    rest = tinker.RestClient(base_url=record.base_url, api_key="tml-dummy")
    left = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert [c.checkpoint_type for c in left] == ["training"]

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    for datum, want in zip(data, expected, strict=True):
        ids = torch.tensor([datum.model_input.to_ints()])
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
        got = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).numpy()
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_cli_deletes_a_checkpoint_and_unknown_paths_are_404(home, restartable, tiny_model):
    record = process.read_record(home)
    service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
    trainer = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    path = trainer.save_state("doomed").result().path
    _tinker_cli(record.base_url, "checkpoint", "delete", "-y", path)
    rest = tinker.RestClient(base_url=record.base_url, api_key="tml-dummy")
    left = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert path not in [c.tinker_path for c in left]
    with pytest.raises(tinker.NotFoundError, match="no checkpoint at"):
        service.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError, match="unknown training run"):
        rest.get_training_run("no-such-run").result()
    healthy, _ = process.health(record.base_url)
    assert healthy

"""`rlcli export` and `rlcli restore` against real servers: the exported adapter (with peft) and
the merged model (plain transformers) reproduce the server's logprobs; --with-optimizer keeps
optimizer.pt (the tinker CLI's archive still leaves it out); a state restored on a second server
continues training exactly as on the first; refusals leave nothing half-written."""

from __future__ import annotations

import io
import json
import os
import tarfile

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from conftest import cli, run_rlcli, train_zebra

PROBE = "Hello there. zebra zebra zebra, and then some other words."


@pytest.fixture(scope="module")
def zebra(server, tiny_model):
    return train_zebra(server.base_url, str(tiny_model))


def _server_logprobs(base_url: str, path: str, ids: list[int]) -> np.ndarray:
    service = tinker.ServiceClient(base_url=base_url, api_key="tml-dummy")
    client = service.create_sampling_client(model_path=path).result()
    logprobs = client.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    return np.array(logprobs[1:], dtype=np.float64)  # the first token has none


def _local_logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1))
    return logp.squeeze(-1).double().numpy()


def test_exported_adapter_and_merged_model_reproduce_the_servers_logprobs(
    server, tiny_model, zebra, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_model)).encode(PROBE)
    expected = _server_logprobs(server.base_url, zebra["sampler"], ids)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    assert np.abs(_local_logprobs(base, ids) - expected).max() > 0.5  # the adapter matters

    adapter = tmp_path / "adapter"
    out = cli(
        "export", "-c", zebra["sampler"], "-o", str(adapter), "--json",
        "--base-url", server.base_url,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["base_model"] == str(tiny_model) and result["lora_rank"] == 16
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        f["file"] for f in result["files"]
    }
    assert not (adapter / "optimizer.pt").exists()
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    np.testing.assert_allclose(_local_logprobs(peft_model, ids), expected, atol=1e-4)

    # A run folder names its checkpoint: the last sampler_path of checkpoints.jsonl.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [
        {"name": "000001", "sampler_path": "tinker://gone/sampler_weights/x"},
        {"name": "final", "sampler_path": zebra["sampler"], "state_path": zebra["state"]},
    ]
    (run_dir / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    merged = tmp_path / "merged"
    out = cli("export", str(run_dir), "-o", str(merged), "--merge", "--base-url", server.base_url)
    assert out.returncode == 0, out.stderr
    assert json.loads((merged / "rlcli_export.json").read_text())["source"] == zebra["sampler"]
    plain = AutoModelForCausalLM.from_pretrained(str(merged)).eval()  # no peft involved
    assert not any("lora" in name for name, _ in plain.named_parameters())
    np.testing.assert_allclose(_local_logprobs(plain, ids), expected, atol=1e-4)
    assert AutoTokenizer.from_pretrained(str(merged)).encode(PROBE) == ids
    umask = os.umask(0)
    os.umask(umask)
    for file in [*merged.iterdir(), *adapter.iterdir()]:  # the usual permissions, not 0600
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file


def test_with_optimizer_keeps_the_optimizer_and_refusals_write_nothing(server, zebra, tmp_path):
    url = ["--base-url", server.base_url]
    home = tmp_path / "home"  # a run named by its folder's name under $RLCLI_HOME/runs
    (home / "runs" / "sl-moving").mkdir(parents=True)
    row = {"name": "final", "sampler_path": zebra["sampler"], "state_path": zebra["state"]}
    (home / "runs" / "sl-moving" / "checkpoints.jsonl").write_text(json.dumps(row) + "\n")
    state_dir = tmp_path / "state"
    out = cli(
        "export", "sl-moving", "-o", str(state_dir), "--with-optimizer", "--json", *url,
        env={"RLCLI_HOME": str(home)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["source"] == zebra["state"]  # the state, not the sampler
    assert (state_dir / "optimizer.pt").stat().st_size > 0
    assert json.loads((state_dir / "run.json").read_text())["lora"]["rank"] == 16

    # What the unmodified tinker CLI downloads is unchanged: no optimizer state.
    run_id, _, name = zebra["state"].removeprefix("tinker://").split("/")
    route = f"{server.base_url}/api/v1/training_runs/{run_id}/checkpoints/weights/{name}/archive"
    link = httpx.get(route, headers={"X-API-Key": "tml-dummy"}).json()["url"]
    with tarfile.open(fileobj=io.BytesIO(httpx.get(link).content)) as tar:
        assert "optimizer.pt" not in tar.getnames() and "run.json" not in tar.getnames()

    refused = cli(
        "export", "-c", zebra["sampler"], "-o", str(tmp_path / "x"), "--with-optimizer", *url
    )
    assert refused.returncode == 1 and "sampler weights (no optimizer state)" in refused.stderr
    assert zebra["state"] in refused.stderr  # names the path that works

    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "mine.txt").write_text("precious")
    busy = cli("export", "-c", zebra["sampler"], "-o", str(keep), *url)
    assert busy.returncode == 1 and "not empty" in busy.stderr
    assert [p.name for p in keep.iterdir()] == ["mine.txt"]

    # A failure after the download (the base model cannot load) leaves no trace beside -o.
    before = sorted(p.name for p in tmp_path.iterdir())
    broken = cli(
        "export", "-c", zebra["sampler"], "-o", str(tmp_path / "merged"), "--merge",
        "--base-model", str(tmp_path / "no-such-model"), *url,
    )  # fmt: skip
    assert broken.returncode == 1 and "cannot load the base model" in broken.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    missing = cli("export", "-c", zebra["sampler"] + "-nope", "-o", str(tmp_path / "y"), *url)
    assert missing.returncode == 1 and "no such checkpoint" in missing.stderr
    (tmp_path / "empty-run").mkdir()
    no_rows = cli("export", str(tmp_path / "empty-run"), "-o", str(tmp_path / "z"), *url)
    assert no_rows.returncode == 1 and "recorded no sampler checkpoint" in no_rows.stderr
    before.append("empty-run")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)


def _step_loss(base_url: str, path: str, datum: types.Datum) -> tuple[float, float]:
    """Resume the state with its optimizer, take one step, return (loss before, loss after)."""
    service = tinker.ServiceClient(base_url=base_url, api_key="tml-dummy")
    trainer = service.create_training_client_from_state_with_optimizer(path).result()
    before = trainer.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    return before, after


def test_a_state_restored_on_another_server_continues_exactly(
    server, second_server, tiny_model, zebra, tmp_path
):
    from transformers import AutoTokenizer

    exported = tmp_path / "moving"
    out = cli(
        "export", "-c", zebra["state"], "-o", str(exported), "--with-optimizer",
        "--base-url", server.base_url,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    ids = AutoTokenizer.from_pretrained(str(tiny_model)).encode(PROBE)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    on_first = _step_loss(server.base_url, zebra["state"], datum)

    url = ["--base-url", second_server.base_url]
    restored = run_rlcli("restore", str(exported), "--json", *url)
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["tinker_path"] == zebra["state"]
    on_second = _step_loss(second_server.base_url, zebra["state"], datum)
    assert on_second[0] == pytest.approx(on_first[0], rel=1e-5)
    assert on_second[1] == pytest.approx(on_first[1], rel=1e-5)  # the Adam moments came too

    again = cli("restore", str(exported), *url)
    assert again.returncode == 1 and "exists here" in again.stderr
    adapter_only = tmp_path / "adapter-only"
    cli("export", "-c", zebra["sampler"], "-o", str(adapter_only), "--base-url", server.base_url)
    refused = cli("restore", str(adapter_only), *url)
    assert refused.returncode == 1 and "--with-optimizer" in refused.stderr


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_restore_route_checks_the_upload_and_writes_nothing_on_refusal(server, zebra, tmp_path):
    exported = tmp_path / "state"
    out = cli(
        "export", "-c", zebra["state"], "-o", str(exported), "--with-optimizer",
        "--base-url", server.base_url,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    names = ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "run.json")
    good = {n: (exported / n).read_bytes() for n in names}
    route = f"{server.base_url}/api/v1/rlcli/restore/moved-run/weights/w"
    key = {"X-API-Key": "tml-dummy"}
    whole = _tar(good)
    cases = {
        "unexpected archive member '../evil'": _tar({**good, "../evil": b"x"}),
        "lacks optimizer.pt": _tar({k: v for k, v in good.items() if k != "optimizer.pt"}),
        "not a whole tar archive": whole[: len(whole) // 2],
        "tensor": _tar(
            {**good, "adapter_model.safetensors": good["adapter_model.safetensors"][:-64]}
        ),
        "LoRA rank differs": _tar({**good, "run.json": json.dumps({"lora": {"rank": 3}}).encode()}),
    }
    for reason, body in cases.items():
        response = httpx.put(route, content=body, headers=key)
        assert response.status_code == 400 and reason in response.json()["detail"], reason
    sampler = httpx.put(route.replace("/weights/", "/sampler_weights/"), content=whole, headers=key)
    assert sampler.status_code == 400
    listed = httpx.get(f"{server.base_url}/api/v1/training_runs/moved-run", headers=key)
    assert listed.status_code == 404  # nothing was written, not even the run
    assert httpx.put(route, content=whole, headers=key).status_code == 200
    assert httpx.put(route, content=whole, headers=key).status_code == 409  # no silent overwrite
    again = httpx.put(route, content=whole, headers=key, params={"overwrite": "true"})
    assert again.status_code == 200


def test_merging_an_adapted_tied_output_layer_leaves_the_input_embedding_alone(
    tiny_model, tmp_path
):
    """With tied embeddings (SmolLM2) the output layer and the input embedding are one matrix,
    and peft merged the output layer's LoRA into it: the merged model then embedded tokens with
    the output layer's update too, unlike the model that was trained. The merge unties it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlcli.client.merge import merge

    config = AutoConfig.from_pretrained(tiny_model)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    folder = tmp_path / "tied"
    base.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
    targets = ["lm_head", "q_proj"]
    trained = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder), LoraConfig(r=4, target_modules=targets)
    )
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    trained.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        want = trained(input_ids=ids).logits

    merge(tmp_path / "adapter", str(folder), tmp_path / "merged", lambda *_: None, False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    embedding = merged.get_input_embeddings().weight
    torch.testing.assert_close(embedding, base.get_input_embeddings().weight)
    assert merged.get_output_embeddings().weight is not embedding
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)


def test_push_to_hub_refuses_in_one_line_before_anything_is_written(server, tmp_path):
    """No hub is reachable here, so the push is tested by its refusals: each is one line,
    asked before the export starts, and leaves -o unwritten. The stand-in endpoints are a
    closed port and a live HTTP server that is not a hub (the Tinker server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    out = tmp_path / "adapter"
    base = ("export", "-c", "tinker://run-x/sampler_weights/final", "-o", str(out))
    quiet = {"HF_HUB_OFFLINE": None, "HF_TOKEN": None, "HF_HOME": str(tmp_path / "hf")}
    token = {**quiet, "HF_TOKEN": "hf_test"}
    cases = [
        ("me/my-model", quiet, "--push-to-hub me/my-model: no Hugging Face token (`hf auth"),
        ("me/my-model", {**token, "HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set; nothing was"),
        ("a/b/c", token, "--push-to-hub 'a/b/c': not a repository id"),
        (
            "me/my-model",
            {**token, "HF_ENDPOINT": f"http://127.0.0.1:{closed}"},
            f"cannot reach http://127.0.0.1:{closed} (ConnectError); nothing was exported",
        ),
        (
            "me/my-model",
            {**token, "HF_ENDPOINT": server.base_url},
            f"--push-to-hub me/my-model: {server.base_url} answered (HTTP 404)",
        ),
    ]
    for repo, env, message in cases:
        result = cli(*base, "--push-to-hub", repo, env=env)
        assert result.returncode == 1, (repo, result.stdout)
        assert message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert not out.exists() and not list(tmp_path.glob(".*"))
    lone = cli(*base, "--hub-private")
    assert lone.returncode == 1 and "--hub-private: only with --push-to-hub REPO" in lone.stderr

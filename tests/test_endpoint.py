"""One server resolution and one-line server errors for every command, the API key the SDK
would send on every request rlcli makes itself, and the small things a user trusts the CLI
for (`--version`, a missing optional package named by its extra). Real server processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from conftest import GSM8K, cli, run_rlcli
from rlcli.launch import pids, process

DEAD_URL = "http://127.0.0.1:9"


def test_resolution_order_is_flag_env_running_server_default(tmp_path, monkeypatch):
    from rlcli.client import endpoint

    monkeypatch.setenv("RLCLI_HOME", str(tmp_path))
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    assert endpoint.resolve_base_url(None) == ("http://localhost:8000", "the default")
    me = process.ServerRecord(
        pid=os.getpid(), host="127.0.0.1", port=8123, base_model="m", backend="torch",
        log_path="x", start_ticks=pids.start_ticks(os.getpid()),
    )  # fmt: skip
    (tmp_path / "server.json").write_text(json.dumps(me.__dict__))
    url, source = endpoint.resolve_base_url(None)
    assert url == "http://127.0.0.1:8123" and f"pid {os.getpid()}" in source
    monkeypatch.setenv("TINKER_BASE_URL", "http://10.0.0.1:9000/")
    assert endpoint.resolve_base_url(None) == ("http://10.0.0.1:9000", "$TINKER_BASE_URL")
    assert endpoint.resolve_base_url("http://h:1") == ("http://h:1", "--base-url")


def test_passthrough_without_a_server_fails_fast_with_trains_line(tmp_path):
    env = {"RLCLI_HOME": str(tmp_path), "TINKER_BASE_URL": DEAD_URL}
    began = time.monotonic()
    result = run_rlcli("run", "list", env=env, timeout=60)
    took = time.monotonic() - began
    assert result.returncode == 1 and took < 15
    assert result.stderr.startswith(f"error: no Tinker server answered at {DEAD_URL} (from ")
    assert len(result.stderr.strip().splitlines()) == 1
    assert "rlcli serve start" in result.stderr and "Traceback" not in result.stderr


def test_passthrough_and_train_find_the_server_running_here(
    tmp_path, server, server_home, tiny_model
):
    env = {"RLCLI_HOME": str(server_home), "TINKER_BASE_URL": ""}  # the session server's home
    listed = run_rlcli("run", "list", "--json", env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    chats = Path(__import__("tinker_cookbook").__file__).parent / "example_data"
    trained = cli(
        "train", "sl", "--dataset", str(chats / "conversations.jsonl"),
        "--model", str(tiny_model), "--max-steps", "1", "--batch-size", "4",
        "--lora-rank", "4", "--log-path", str(tmp_path / "run"), env=env,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    said = f"server: {server.base_url} (the server running here, pid {server.pid})"
    assert said in trained.stderr


def test_status_and_passthrough_send_the_api_key(keyed_server):
    home, record = keyed_server
    right = {"RLCLI_HOME": str(home), "TINKER_API_KEY": "tml-secret", "TINKER_BASE_URL": ""}
    status = cli("serve", "status", "--json", env=right)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["device"] == "cpu"  # the keyed /rlcli/status answered
    listed = run_rlcli("run", "list", env=right, timeout=120)
    assert listed.returncode == 0, listed.stderr
    wrong = {**right, "TINKER_API_KEY": "tml-wrong"}
    refused = run_rlcli("run", "list", env=wrong, timeout=60)
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: the server at {record.base_url} refused the API")
    assert "TINKER_API_KEY" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def test_the_openai_endpoint_takes_the_key_as_openai_clients_send_it(keyed_server, tiny_model):
    """``Authorization: Bearer`` (the openai package) and ``X-API-Key`` both open /v1; no key
    or a wrong one is a 401/403 in OpenAI's error shape."""
    import openai

    _, record = keyed_server
    url = f"{record.base_url}/v1"
    right = openai.OpenAI(base_url=url, api_key="tml-secret", max_retries=0)
    assert [m.id for m in right.models.list().data] == [str(tiny_model)]
    answer = right.chat.completions.create(
        model=str(tiny_model), messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.usage.completion_tokens >= 1
    wrong = openai.OpenAI(base_url=url, api_key="tml-wrong", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        wrong.models.list()
    assert refused.value.body["type"] == "authentication_error"
    by_header = httpx.get(f"{url}/models", headers={"X-API-Key": "tml-secret"})
    assert by_header.status_code == 200
    bare = httpx.get(f"{url}/models")
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"


def test_train_rl_against_a_keyed_server(keyed_server, tiny_model, tmp_path):
    home, record = keyed_server
    args = (
        "train", "rl", "--model", str(tiny_model), "--base-url", record.base_url,
        "--gsm8k-dir", str(GSM8K), "--batch-size", "2", "--group-size", "2",
        "--max-tokens", "8", "--max-steps", "1", "--lora-rank", "4", "--json",
    )  # fmt: skip
    right = cli(*args, "--log-path", str(tmp_path / "ok"), env={"TINKER_API_KEY": "tml-secret"})
    assert right.returncode == 0, right.stderr[-3000:]
    assert json.loads(right.stdout)["state_path"].startswith("tinker://")
    # progress from the first second, sampling included: 2 problems x 2 rollouts
    assert right.stderr.index("starting") < right.stderr.index("sampling rollouts")
    assert re.search(r"^sampling rollouts [0-4]/4 \(step 1\)$", right.stderr, re.M), right.stderr
    wrong = cli(*args, "--log-path", str(tmp_path / "no"), env={"TINKER_API_KEY": "tml-nope"})
    assert wrong.returncode == 1
    errors = [ln for ln in wrong.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "refused the API key" in errors[0], wrong.stderr
    assert "Traceback" not in wrong.stderr


def test_version():
    result = cli("--version")
    from importlib.metadata import version

    assert result.returncode == 0 and result.stdout.strip() == f"rlcli {version('rlcli')}"


def test_import_gguf_without_the_package_names_the_extra(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 64)
    # gguf is a core dependency now: an install without it is an old or broken one
    result = run_rlcli("models", "import-gguf", str(fake), str(tmp_path / "out"), without="gguf")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: models import-gguf needs the gguf package, which is not installed: "
        "pip install 'rlcli[gguf]'"
    )
    missing = cli("models", "import-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "o"))
    assert missing.returncode == 1 and "no such GGUF file" in missing.stderr
    assert "Traceback" not in result.stderr + missing.stderr


def test_the_tinker_cli_is_run_with_the_resolved_url(tmp_path):
    # --help needs no server: the pass-through answers without checking one.
    result = subprocess.run(
        [*__import__("conftest").RLCLI, "checkpoint", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "RLCLI_HOME": str(tmp_path), "TINKER_BASE_URL": DEAD_URL},
        timeout=60,
    )
    assert result.returncode == 0 and "list" in result.stdout

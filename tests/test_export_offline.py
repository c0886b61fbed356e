"""``export`` of a finished local run with no server running: the checkpoint's files are read
from this machine's checkpoints folder (``$RLCLI_HOME/checkpoints``) and the run's record
(``checkpoints.jsonl``), so PEFT, merged and GGUF exports need no server. And the server's
``--checkpoint-ttl``: how long local checkpoints are kept, whatever the cookbook asks.

One server of the tiny model, started here (the test stops it), two SFT steps."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from conftest import cli, start_server

TEXT = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nzebra"


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, tiny_model):
    """(home, run folder, the server's checkpoint listing) of two SFT steps on a server kept
    30 days (``--checkpoint-ttl 30d``), stopped before any export."""
    home = tmp_path_factory.mktemp("offline-home")
    record = start_server(home, tiny_model, checkpoint_ttl="30d")
    env = {"RLCLI_HOME": str(home), "TINKER_BASE_URL": ""}
    try:
        chats = Path(__import__("tinker_cookbook").__file__).parent / "example_data"
        run_dir = home / "runs" / "two-steps"
        trained = cli(
            "train", "sl", "--dataset", str(chats / "conversations.jsonl"),
            "--model", str(tiny_model), "--max-steps", "2", "--batch-size", "4",
            "--lora-rank", "4", "--log-path", str(run_dir), env=env,
        )  # fmt: skip
        assert trained.returncode == 0, trained.stderr[-3000:]
        rows = [
            json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()
        ]
        run_id = rows[-1]["sampler_path"].removeprefix("tinker://").split("/")[0]
        listed = httpx.get(
            f"{record.base_url}/api/v1/training_runs/{run_id}/checkpoints", timeout=30
        ).json()["checkpoints"]
    finally:
        stopped = cli("serve", "stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    return home, run_dir, listed


def test_a_stopped_servers_run_exports_as_peft_merged_and_gguf(stopped_run, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcli.models.gguf import check_gguf

    home, run_dir, _ = stopped_run
    env = {"RLCLI_HOME": str(home), "TINKER_BASE_URL": "http://127.0.0.1:9"}  # nothing there
    peft_dir, merged_dir, gguf_file = tmp_path / "peft", tmp_path / "merged", tmp_path / "m.gguf"
    for extra in (["-o", str(peft_dir)], ["-o", str(merged_dir), "--merge"],
                  ["-o", str(gguf_file), "--gguf"]):  # fmt: skip
        done = cli("export", str(run_dir), *extra, "--json", env=env)
        assert done.returncode == 0, done.stderr
        assert "(no server needed)" in done.stderr and "server:" not in done.stderr
    state = tmp_path / "state"
    done = cli("export", str(run_dir), "-o", str(state), "--with-optimizer", env=env)
    assert done.returncode == 0 and (state / "optimizer.pt").is_file(), done.stderr
    assert (state / "run.json").is_file()
    check_gguf(gguf_file)  # a whole GGUF model
    # the merged model computes what base + adapter compute
    manifest = json.loads((peft_dir / "rlcli_export.json").read_text())
    base = manifest["base_model"]
    ids = AutoTokenizer.from_pretrained(base)(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        adapted = PeftModel.from_pretrained(model, str(peft_dir))(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(merged_dir))(ids).logits
    assert torch.allclose(adapted, merged, atol=1e-4)


def test_an_export_without_local_files_or_server_is_one_line(stopped_run, tmp_path):
    home, run_dir, _ = stopped_run
    env = {"RLCLI_HOME": str(home), "TINKER_BASE_URL": "http://127.0.0.1:9"}
    elsewhere = tmp_path / "empty-checkpoints"
    elsewhere.mkdir()
    done = cli(
        "export", str(run_dir), "-o", str(tmp_path / "o"), "--checkpoints-dir", str(elsewhere),
        env=env,
    )  # fmt: skip
    assert done.returncode == 1 and not (tmp_path / "o").exists()
    assert done.stderr.startswith(f"error: --checkpoints-dir {elsewhere}: no checkpoint tinker://")
    # with the server named, it is asked (and nothing answers there)
    done = cli(
        "export", str(run_dir), "-o", str(tmp_path / "o"), "--base-url", env["TINKER_BASE_URL"]
    )
    assert done.returncode == 1 and "no Tinker server answered" in done.stderr


def test_checkpoint_ttl_is_the_servers_rule_not_the_cookbooks(stopped_run):
    """The cookbook asks 7 days for every checkpoint; ``--checkpoint-ttl 30d`` keeps them 30."""
    _, _, listed = stopped_run
    assert listed
    for checkpoint in listed:
        created = _seconds(checkpoint["time"])
        assert abs(_seconds(checkpoint["expires_at"]) - created - 30 * 86400) < 600


def _seconds(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


@pytest.mark.parametrize(
    ("given", "rule"),
    [("client", "client"), ("never", "never"), ("30", 30 * 86400.0), ("12h", 43200.0),
     ("90m", 5400.0), ("45s", 45.0)],
)  # fmt: skip
def test_checkpoint_ttl_values(given, rule):
    from rlcli.checkpoint_format import expires_at, parse_checkpoint_ttl

    assert parse_checkpoint_ttl(given) == rule
    now = time.time()
    asked = 7 * 86400
    want = None if rule == "never" else now + (asked if rule == "client" else rule)
    assert expires_at(rule, asked, now) == want


@pytest.mark.parametrize("given", ["soon", "0", "-3d", "200y"])
def test_a_bad_checkpoint_ttl_is_one_line(given, tmp_path):
    done = cli(
        "serve", "start", "--base-model", "org/m", "--checkpoint-ttl", given, "--dry-run",
        env={"RLCLI_HOME": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 1 and done.stderr.startswith(f"error: --checkpoint-ttl {given}: ")
    assert len(done.stderr.strip().splitlines()) == 1

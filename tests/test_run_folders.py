"""What a run folder promises (issue 26): it belongs to the command and settings it was started
with, and what rlcli says about it is true. In-process (typer's CliRunner) where no run is
needed; the runs themselves use the session's shared server."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import GSM8K
from rlcli.cli.main import app
from rlcli.errors import RlcliError
from rlcli.recipes import options
from rlcli.recipes.rl import RLOptions
from rlcli.recipes.sl import SLOptions

DEAD_URL = "http://127.0.0.1:9"
EXAMPLES = Path(__import__("tinker_cookbook").__file__).parent / "example_data"


def invoke(*args: str):
    """``rlcli ARGS`` in this process; a refusal is the ``RlcliError`` it raised."""
    return CliRunner().invoke(app, list(args))


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def rl_folder(tmp_path, tiny_model) -> Path:
    """A run folder an RL run left: its config.yaml, checkpoints and record."""
    folder = tmp_path / "rl-run"
    folder.mkdir()
    opts = RLOptions(
        model=str(tiny_model), dataset="gsm8k", gsm8k_dir=str(GSM8K), renderer="qwen3_instruct"
    )
    options.write_config(folder, opts, "rlcli train rl")
    (folder / "checkpoints.jsonl").write_text('{"name": "final", "batch": 4}\n')
    (folder / "rlcli_run.json").write_text('{"kind": "rl", "status": "finished"}\n')
    return folder


def test_training_into_another_commands_folder_is_one_line_and_changes_nothing(
    rl_folder, tiny_model
):
    before = snapshot(rl_folder)
    chats = EXAMPLES / "conversations.jsonl"
    for extra in ((), ("--dry-run",)):
        result = invoke(
            "train", "sl", "--dataset", str(chats), "--model", str(tiny_model),
            "--base-url", DEAD_URL, "--log-path", str(rl_folder), *extra,
        )  # fmt: skip
        assert isinstance(result.exception, RlcliError), result.output
        message = str(result.exception)
        assert "\n" not in message
        assert "a `rlcli train rl` run" in message and "`rlcli train sl` cannot" in message
    assert snapshot(rl_folder) == before  # config.yaml, kind and checkpoints untouched


def test_a_different_setting_in_the_same_commands_folder_names_both_values(rl_folder, tiny_model):
    before = snapshot(rl_folder)
    result = invoke(
        "train", "rl", "--model", str(tiny_model), "--gsm8k-dir", str(GSM8K),
        "--base-url", DEAD_URL, "--log-path", str(rl_folder), "--lr", "1e-3", "--dry-run",
    )  # fmt: skip
    assert isinstance(result.exception, RlcliError), result.output
    message = str(result.exception)
    assert "--lr 4e-05" in message and "this command 0.001" in message
    assert f"--config {rl_folder}/config.yaml --log-path {rl_folder}" in message
    assert snapshot(rl_folder) == before


def test_a_resume_may_change_where_it_runs_how_far_and_how_often_it_saves(rl_folder, tiny_model):
    result = invoke(
        "train", "rl", "--model", str(tiny_model), "--gsm8k-dir", str(GSM8K),
        "--base-url", DEAD_URL, "--log-path", str(rl_folder), "--max-steps", "9",
        "--save-every", "3", "--dry-run", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert set(options.RESUMABLE) >= {"base_url", "max_steps", "save_every"}


def test_an_empty_or_new_folder_is_anyones(tmp_path, tiny_model):
    opts = SLOptions(model=str(tiny_model), dataset="x.jsonl")
    options.check_same_run(tmp_path, opts, "rlcli train sl")  # empty: no error
    options.check_same_run(tmp_path / "new", opts, "rlcli train sl")

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


# ---- item 3: what a stopped run says, and what a rerun appends ------------------------------


def _rows(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_rerun_drops_the_steps_no_checkpoint_holds(tmp_path):
    import json

    from rlcli.runs import runner

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(5)))
    runner.drop_unsaved_steps(tmp_path)  # no checkpoint: the rerun starts over
    assert _rows(metrics) == []
    assert runner._resume_line(tmp_path, "CMD").startswith("No checkpoint was saved yet")
    assert "Resume with" not in runner._resume_line(tmp_path, "CMD")

    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    (tmp_path / "checkpoints.jsonl").write_text(
        json.dumps({"name": "000003", "batch": 3, "state_path": "tinker://r/weights/000003"}) + "\n"
    )
    runner.drop_unsaved_steps(tmp_path)  # checkpoint 000003 holds steps 0..2
    assert [r["step"] for r in _rows(metrics)] == [0, 1, 2]
    # sl: the loop position says it (an epoch of 2 batches, then batch 1: 3 steps held)
    (tmp_path / "rlcli_spec.json").write_text(json.dumps({"plan": {"batches_per_epoch": 2}}))
    sl_row = {"name": "000002", "epoch": 1, "batch": 1, "state_path": "tinker://r/w/2"}
    (tmp_path / "checkpoints.jsonl").write_text(json.dumps(sl_row) + "\n")
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    runner.drop_unsaved_steps(tmp_path)
    assert [r["step"] for r in _rows(metrics)] == [0, 1, 2]
    (tmp_path / "rlcli_spec.json").unlink()
    (tmp_path / "checkpoints.jsonl").write_text(
        json.dumps({"name": "000003", "batch": 3, "state_path": "tinker://r/weights/000003"}) + "\n"
    )
    assert runner._resume_line(tmp_path, "CMD") == "Resume with: CMD"

    with (tmp_path / "checkpoints.jsonl").open("a") as f:
        final = {"name": "final", "batch": 5, "state_path": "tinker://r/w/final"}
        f.write(json.dumps(final) + "\n")
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    runner.drop_unsaved_steps(tmp_path)  # a finished run keeps every row
    assert len(_rows(metrics)) == 5


def test_ctrl_c_saves_a_checkpoint_and_every_step_count_agrees(tmp_path, server, tiny_model):
    """Ctrl-C stops at the step boundary with a checkpoint, as `runs cancel` does; the step
    the message, the status events, checkpoints.jsonl and `runs show` give is one count; the
    resume appends no step twice."""
    import json
    import signal
    import subprocess

    from conftest import RLCLI, cli, wait_for_steps

    run_dir = tmp_path / "run"
    argv = [
        *RLCLI, "train", "sl", "--dataset", str(EXAMPLES / "conversations.jsonl"),
        "--model", str(tiny_model), "--base-url", server.base_url, "--log-path", str(run_dir),
        "--batch-size", "2", "--save-every", "3", "--lora-rank", "4",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        wait_for_steps(run_dir, 4, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    done = len(_rows(run_dir / "metrics.jsonl"))
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-2000:]
    assert (
        f"interrupted (Ctrl-C) after step {done}; final checkpoint: state_path tinker://"
        in (errors[0])
    )
    assert "Resume with: rlcli train sl --config" in errors[0]
    checkpoints = _rows(run_dir / "checkpoints.jsonl")
    names = [c["name"] for c in checkpoints]
    assert len(names) == len(set(names))  # no row twice
    assert names[0] == "000003" and names[-1] == f"{done:06d}"
    for c in checkpoints:  # named by the optimizer steps it holds: the batch that comes next
        assert int(c["name"]) == 64 * c["epoch"] + c["batch"], c
    events = _rows(run_dir / "rlcli_status.jsonl")
    saving = {e["step"] + 1 for e in events if e["phase"] == "saving checkpoint"}
    assert saving <= {int(n) for n in names} and 3 in saving
    cancelled = [e["step"] + 1 for e in events if e["phase"] == "cancelled"]
    assert cancelled == [done]
    shown = json.loads(cli("runs", "show", str(run_dir), "--json").stdout)
    assert shown["steps_done"] == done

    resumed = cli(*argv[3:], "--max-steps", str(done + 2), "--json")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    steps = [r["step"] for r in _rows(run_dir / "metrics.jsonl")]
    assert steps == list(range(done + 2))  # continued after the Ctrl-C checkpoint, no repeats


def test_runs_started_at_once_are_all_in_the_index(tmp_path, monkeypatch):
    """Each run outside $RLCLI_HOME/runs adds itself to index.txt; sixteen at once lose none."""
    import threading

    from rlcli.runs.runner import register_run

    monkeypatch.setenv("RLCLI_HOME", str(tmp_path / "home"))
    folders = [tmp_path / "elsewhere" / f"run{i}" for i in range(16)]
    for folder in folders:
        folder.mkdir(parents=True)
    threads = [threading.Thread(target=register_run, args=(f,)) for f in folders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    index = (tmp_path / "home" / "runs" / "index.txt").read_text().splitlines()
    assert sorted(index) == sorted(str(f.resolve()) for f in folders)

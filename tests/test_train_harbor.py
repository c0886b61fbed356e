"""`rlcli train harbor` end to end: the tiny model on the example tasks through the cookbook's
harbor_rl with rlcli's Docker sandbox, on a real server and a real Docker daemon; exact resume
through the run's config.yaml, W&B offline, and no container left behind after a finished run,
a Ctrl-C, or a SIGKILLed recipe child; a missing daemon is one line before the run folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import RLCLI, cli
from rlcli.harbor import docker
from rlcli.recipes.harbor import run_id

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "harbor-tasks"


def args(server, tiny_model, log_path, *extra) -> list[str]:
    return [
        "train", "harbor", "--model", str(tiny_model), "--base-url", server.base_url,
        "--dataset", str(EXAMPLES), "--group-size", "2", "--groups-per-batch", "2",
        "--max-tokens", "16", "--max-turns", "2", "--log-path", str(log_path), *extra,
    ]  # fmt: skip


def containers_of(run_dir: Path) -> list[str]:
    return docker.run_containers(run_id(run_dir))


def test_two_steps_resume_exactly_through_config_yaml_with_wandb(
    tmp_path, server, tiny_model, daemon
):
    run_dir = tmp_path / "run"
    first = cli(*args(server, tiny_model, run_dir, "--max-steps", "1", "--save-every", "1"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "3 tasks, 1 steps of 4 rollouts in docker containers" in first.stderr
    assert "step 1/1" in first.stderr
    assert containers_of(run_dir) == []
    # Every rollout had its own container, started and removed.
    rows = [json.loads(line) for line in (run_dir / docker.STATS_FILE).open()]
    assert len(rows) == 4 and len({r["container"] for r in rows}) == 4
    assert {r["task"] for r in rows} == {"compute-value", "fix-script"}  # the first batch
    assert all(r["start_s"] > 0 and r["remove_s"] > 0 for r in rows)

    second = cli(
        "train", "harbor", "--config", str(run_dir / "config.yaml"), "--log-path", str(run_dir),
        "--max-steps", "2", "--json", "--wandb-project", "rlcli-test",
        env={"WANDB_MODE": "offline", "WANDB_API_KEY": ""},  # the key it fills in is undone after
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming in" in second.stderr
    summary = json.loads(second.stdout)
    assert summary["state_path"].startswith("tinker://") and summary["final_reward"] is not None
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps == [0, 1]  # step 0 was not redone
    rows = [json.loads(line) for line in (run_dir / docker.STATS_FILE).open()]
    assert len(rows) == 6 and rows[-1]["task"] == "write-file"  # the second batch: one task
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert containers_of(run_dir) == []


def _start(server, tiny_model, run_dir) -> subprocess.Popen:
    return subprocess.Popen(
        [*RLCLI, *args(server, tiny_model, run_dir, "--max-tokens", "64", "--max-turns", "4")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_containers(proc: subprocess.Popen, run_dir: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if containers_of(run_dir):
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before any container started: {proc.stderr.read()}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail("no container started")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_ctrl_c_mid_rollout_leaves_no_container(tmp_path, server, tiny_model, daemon):
    run_dir = tmp_path / "run"
    proc = _start(server, tiny_model, run_dir)
    _wait_for_containers(proc, run_dir)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    # Ctrl-C asks for a checkpoint at the step's end (10 s at most): resume from it, or, with
    # none saved yet, the line says the same command starts over
    assert "interrupted (Ctrl-C)" in stderr and "stopped the run." in stderr
    assert "Resume with:" in stderr or "No checkpoint was saved yet" in stderr
    assert containers_of(run_dir) == []
    assert json.loads((run_dir / "rlcli_run.json").read_text())["status"] == "interrupted"


def test_a_sigkilled_recipe_child_leaves_no_container(tmp_path, server, tiny_model, daemon):
    run_dir = tmp_path / "run"
    proc = _start(server, tiny_model, run_dir)
    _wait_for_containers(proc, run_dir)
    children = _children(proc.pid)
    assert children, "no recipe child"
    for pid in children:
        os.kill(pid, signal.SIGKILL)  # no cleanup of its own can run
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    assert containers_of(run_dir) == []  # the parent removed them by the run's label


def test_a_missing_daemon_is_one_line_before_the_run_folder(tmp_path, server, tiny_model):
    run_dir = tmp_path / "run"
    result = cli(
        *args(server, tiny_model, run_dir), env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    )
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "error: --sandbox docker: no Docker daemon answers at unix:///nonexistent/docker.sock"
    )
    assert not run_dir.exists()

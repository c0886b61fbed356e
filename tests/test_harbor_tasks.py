"""Harbor task folders without any Docker daemon or server: loading and validation (one clear
line per bad folder), --task-filter / --max-tasks, name@version datasets, and
`rlcli train harbor --dry-run`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import cli, run_rlcli
from rlcli.errors import RlcliError
from rlcli.harbor import tasks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "harbor-tasks"
NAMES = ["compute-value", "fix-script", "write-file"]


def copy_task(tmp_path: Path, name: str = "write-file") -> Path:
    target = tmp_path / "tasks" / name
    shutil.copytree(EXAMPLES / name, target)
    return target


def test_example_tasks_load_with_their_limits_and_solutions():
    found = tasks.load_tasks(EXAMPLES)
    assert [t.name for t in found] == NAMES
    for task in found:
        assert task.instruction.strip() and task.solution is not None
        assert task.cpus == 1.0 and task.memory_mb == 256 and task.allow_internet is False
        assert task.verifier_timeout_s == 30 and task.docker_image is None
        assert (task.environment / "Dockerfile").read_text().startswith("FROM rlcli-harbor-base")


def test_filter_and_max_tasks():
    assert [t.name for t in tasks.load_tasks(EXAMPLES, "fix-*")] == ["fix-script"]
    picked = tasks.load_tasks(EXAMPLES, "write-file,compute-*")
    assert [t.name for t in picked] == ["compute-value", "write-file"]
    assert [t.name for t in tasks.load_tasks(EXAMPLES, max_tasks=2)] == NAMES[:2]
    with pytest.raises(RlcliError, match=r"--task-filter nope\*: no task of .* matches it"):
        tasks.load_tasks(EXAMPLES, "nope*")
    # One task folder given directly is a dataset of one.
    assert [t.name for t in tasks.load_tasks(EXAMPLES / "fix-script")] == ["fix-script"]


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda t: (t / "instruction.md").unlink(), "no instruction.md"),
        (lambda t: (t / "instruction.md").write_text("  \n"), "instruction.md is empty"),
        (lambda t: (t / "task.toml").unlink(), "no task.toml"),
        (lambda t: (t / "task.toml").write_text("[environment\n"), "task.toml is not valid TOML"),
        (lambda t: (t / "environment" / "Dockerfile").unlink(), "no environment/Dockerfile"),
        (lambda t: (t / "tests" / "test.sh").unlink(), "no tests/test.sh"),
        (
            lambda t: (t / "task.toml").write_text("[environment]\ncpus = -1\n"),
            "cpus -1: expected a positive number",
        ),
        (
            lambda t: (t / "task.toml").write_text('[environment]\nmemory = "lots"\n'),
            "memory 'lots'",
        ),
        (
            lambda t: (t / "task.toml").write_text('[environment]\nallow_internet = "yes"\n'),
            "allow_internet must be true or false",
        ),
    ],
)
def test_a_bad_task_folder_is_one_line_naming_it(tmp_path, breakage, expected):
    task = copy_task(tmp_path)
    breakage(task)
    with pytest.raises(RlcliError) as caught:
        tasks.load_tasks(task.parent)
    message = str(caught.value)
    assert message.startswith(f"task {task}: ") and expected in message, message
    assert "\n" not in message


def test_memory_spellings_and_a_prebuilt_image(tmp_path):
    task = copy_task(tmp_path)
    (task / "environment" / "Dockerfile").unlink()
    (task / "task.toml").write_text(
        '[environment]\ndocker_image = "my/image:1"\nmemory = "1.5G"\nallow_internet = true\n'
    )
    loaded = tasks.load_task(task)
    assert loaded.docker_image == "my/image:1" and loaded.memory_mb == 1536
    assert loaded.allow_internet is True


def test_a_dataset_name_missing_from_the_cache_says_how_to_use_a_local_folder(tmp_path):
    # No uvx on PATH: the download cannot even start.
    env = {"HARBOR_CACHE_DIR": str(tmp_path / "cache"), "PATH": str(tmp_path / "empty")}
    result = cli(
        "train", "harbor", "--model", "Qwen/Qwen3-0.6B", "--dataset", "terminal-bench@2.0",
        "--dry-run", env=env,
    )  # fmt: skip
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --dataset terminal-bench@2.0: not in the Harbor cache")
    assert "uvx" in line and "--dataset examples/harbor-tasks" in line
    # A uvx that fails (as it does offline): the same advice, with its last line.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "uvx").write_text("#!/bin/sh\necho 'error: failed to fetch harbor: offline' >&2\n"
                                 "exit 2\n")  # fmt: skip
    (bin_dir / "uvx").chmod(0o755)
    result = cli(
        "train", "harbor", "--model", "Qwen/Qwen3-0.6B", "--dry-run",
        env={**env, "PATH": str(bin_dir)},
    )  # fmt: skip
    line = result.stderr.strip().splitlines()[-1]
    assert "`uvx harbor datasets download` failed (error: failed to fetch harbor: offline)" in line
    assert "--dataset examples/harbor-tasks" in line


def test_a_dataset_in_the_harbor_cache_is_used_by_name(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    # As Harbor's downloads lay them out: each task in a hash folder.
    shutil.copytree(EXAMPLES / "fix-script", cache / "mini-1.0" / "Xk3bQ9" / "fix-script")
    shutil.copytree(EXAMPLES / "write-file", cache / "mini-1.0" / "a7Zr2m" / "write-file")
    monkeypatch.setenv("HARBOR_CACHE_DIR", str(cache))
    folder, source = tasks.resolve_dataset("mini@1.0")
    assert folder == cache / "mini-1.0" and source.startswith("Harbor cache")
    assert [t.name for t in tasks.load_tasks(folder)] == ["fix-script", "write-file"]


def test_dry_run_validates_the_tasks_with_no_daemon_and_no_server(tmp_path, tiny_model):
    result = cli(
        "train", "harbor", "--model", str(tiny_model), "--dataset", str(EXAMPLES),
        "--groups-per-batch", "2", "--task-filter", "*-*", "--dry-run", "--json",
        "--base-url", "http://127.0.0.1:9", "--log-path", str(tmp_path / "run"),
        env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["tasks"] == NAMES and plan["steps"] == 2 and plan["rollouts_per_step"] == 8
    assert plan["dataset"] == str(EXAMPLES) and plan["sandbox"] == "docker"
    assert plan["options"]["group_size"] == 4 and plan["options"]["max_turns"] == 10
    assert plan["options"]["lr"] == 1e-5 and plan["options"]["command_timeout"] == 120
    assert not (tmp_path / "run").exists()
    # A broken task is named before anything runs.
    task = copy_task(tmp_path)
    (task / "tests" / "test.sh").unlink()
    result = cli(
        "train", "harbor", "--model", str(tiny_model), "--dataset", str(task.parent), "--dry-run"
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: task {task}: no tests/test.sh (the verifier)"
    )


def test_modal_without_the_package_is_a_clear_error(tiny_model):
    result = run_rlcli(
        "train", "harbor", "--model", str(tiny_model), "--dataset", str(EXAMPLES),
        "--sandbox", "modal", "--dry-run", without="modal",
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --sandbox modal: the modal package is not installed (pip install 'rlcli[modal]')"
    )

"""`rlcli runs list | show | plot | cancel` and `train --detach`, on run folders made by real
`rlcli train sl` runs against the session server with the tiny model: a finished run, a failed
one (its recipe process killed), one stopped with Ctrl-C, one whose `rlcli` was killed with
SIGKILL (its record still says running, its lock is free), and a detached run that is followed,
cancelled with a final checkpoint the server holds, and resumed from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import RLCLI, cli, recipe_children, steps_logged

EXAMPLES = Path(__import__("tinker_cookbook").__file__).parent / "example_data"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rlcli-home")


@pytest.fixture(scope="module")
def env(home) -> dict:
    return {**os.environ, "RLCLI_HOME": str(home)}


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text((EXAMPLES / "conversations.jsonl").read_text())
    return path


def train_argv(server, model, chats, run_dir: Path | None, *extra) -> list[str]:
    where = ["--log-path", str(run_dir)] if run_dir else []
    return [
        *RLCLI, "train", "sl", "--dataset", str(chats), "--model", str(model),
        "--base-url", server.base_url, "--lora-rank", "4", *where, *extra,
    ]  # fmt: skip


def rlcli(env, *args) -> subprocess.CompletedProcess:
    """`rlcli runs ...` in this process (conftest.cli); the runs themselves are processes."""
    return cli(*args, env=env)


def as_json(result: subprocess.CompletedProcess):
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def wait_until(predicate, timeout=60.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, server, tiny_model, chats, env, home) -> dict[str, Path]:
    """Four runs made at once: finished (in $RLCLI_HOME/runs), failed, interrupted (Ctrl-C),
    killed (SIGKILL of rlcli); the last three under a --log-path outside the home, each
    stopped as soon as it has two steps."""
    outside = tmp_path_factory.mktemp("elsewhere")
    # 2560 steps: far from done when the signals come, however fast the machine is
    long = ("--batch-size", "2", "--epochs", "40", "--save-every", "50")
    argv = {"finished": train_argv(server, tiny_model, chats, None, "--batch-size", "8",
                                   "--max-steps", "3")}  # fmt: skip
    dirs = {name: outside / name for name in ("failed", "interrupted", "killed")}
    argv |= {name: train_argv(server, tiny_model, chats, run_dir, *long)
             for name, run_dir in dirs.items()}  # fmt: skip
    # Output goes to files: a run prints a line a step, and one left running on a pipe nobody
    # reads fills it (64 KiB, ~1,450 steps) and blocks before it can see its recipe die.
    logs = {name: outside / f"{name}.out" for name in argv}
    procs = {}
    for name, args in argv.items():
        with logs[name].open("w") as out:
            procs[name] = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    stop = {
        "failed": lambda: os.kill(only(recipe_children(dirs["failed"])), signal.SIGKILL),
        "interrupted": lambda: procs["interrupted"].send_signal(signal.SIGINT),
        "killed": procs["killed"].kill,  # no handler runs: the record still says running
    }  # failed: the recipe crashes, and rlcli reports a failed run

    def tail(name: str) -> str:
        return f"{name}: {logs[name].read_text()[-1500:]}"

    try:
        deadline = time.monotonic() + 180
        while stop:  # each one as soon as it has two steps: the runs may start far apart
            for name in [n for n in stop if steps_logged(dirs[n]) >= 2]:
                stop.pop(name)()
            assert all(procs[n].poll() is None for n in stop), "a run ended before its signal"
            assert time.monotonic() < deadline, f"no two steps in 180 s: {[*map(tail, stop)]}"
            time.sleep(0.1)
        codes = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"still running after 180 s: {tail(name)}") from None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    assert codes == {"finished": 0, "failed": 1, "interrupted": 130, "killed": -9}, (
        codes, [*map(tail, procs)]
    )  # fmt: skip
    (finished,) = [p for p in (home / "runs").iterdir() if p.is_dir()]
    wait_until(lambda: not recipe_children(dirs["killed"]), 15, "the killed run's recipe to end")
    return {"finished": finished, **dirs}


def only(pids: list[int]) -> int:
    (pid,) = pids
    return pid


@pytest.mark.slow
def test_list_show_and_plot_real_runs(runs, env, tmp_path):
    listed = {r["id"]: r for r in as_json(rlcli(env, "runs", "list", "--json"))}
    assert set(listed) >= {p.name for p in runs.values()}
    by = {name: listed[path.name] for name, path in runs.items()}
    for name, row in by.items():
        assert row["kind"] == "sl" and row["model"].endswith("tiny"), row
        assert row["run_dir"] == str(runs[name].resolve())
    assert by["finished"]["status"] == "finished"
    assert (by["finished"]["steps_done"], by["finished"]["total_steps"]) == (3, 3)
    assert by["finished"]["last_metric"] == "loss" and by["finished"]["last_value"] > 0
    assert by["finished"]["exit_code"] == 0 and by["finished"]["duration_s"] > 0
    assert by["failed"]["status"] == "failed" and by["failed"]["exit_code"] == 1
    assert "exit code -9" in by["failed"]["error"]
    assert by["interrupted"]["status"] == "interrupted" and by["interrupted"]["exit_code"] == 130
    assert "Ctrl-C" in by["interrupted"]["error"]
    assert by["killed"]["status"] == "interrupted"  # recorded running, lock free
    assert "SIGKILL" in by["killed"]["error"]
    for name in ("failed", "interrupted", "killed"):
        assert by[name]["steps_done"] >= 2 and by[name]["total_steps"] == 2560
    order = [r["id"] for r in as_json(rlcli(env, "runs", "list", "--json"))]
    started = [listed[i]["started"] for i in order]
    assert started == sorted(started, reverse=True)  # newest first

    table = rlcli(env, "runs", "list")
    assert table.returncode == 0 and runs["killed"].name in table.stdout
    assert "interrupted" in table.stdout and "loss" in table.stdout

    shown = as_json(rlcli(env, "runs", "show", runs["finished"].name, "--json"))
    assert shown["config"]["model"].endswith("tiny") and shown["config"]["batch_size"] == 8
    assert shown["last_metrics"]["step"] == 2
    final = shown["checkpoints"][-1]
    assert final["name"] == "final" and final["state_path"].startswith("tinker://")
    assert shown["summary"]["final_loss"] == pytest.approx(shown["last_value"])
    failed = as_json(rlcli(env, "runs", "show", str(runs["failed"]), "--json"))  # by path
    assert failed["status"] == "failed" and "exit code -9" in failed["error"]
    human = rlcli(env, "runs", "show", runs["failed"].name)
    assert human.returncode == 0 and "exit code -9" in human.stdout

    out = tmp_path / "curves.png"
    plotted = as_json(
        rlcli(env, "runs", "plot", runs["finished"].name, runs["interrupted"].name,
              "-o", str(out), "--json")
    )  # fmt: skip
    assert plotted["path"] == str(out) and out.read_bytes()[:8] == PNG
    (panel,) = plotted["panels"]
    assert panel["metric"] == "train_mean_nll"
    points = {s["run"]: s["points"] for s in panel["series"]}
    assert points == {
        runs["finished"].name: 3,
        runs["interrupted"].name: by["interrupted"]["steps_done"],
    }

    unknown = rlcli(env, "runs", "show", "no-such-run")
    assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1
    assert "no run 'no-such-run'" in unknown.stderr
    not_running = rlcli(env, "runs", "cancel", runs["finished"].name)
    assert not_running.returncode == 1
    assert "is not running (finished); nothing to cancel" in not_running.stderr


@pytest.mark.slow
def test_detach_follow_cancel_and_resume(server, tiny_model, chats, env, tmp_path):
    """`train sl --dataset - --detach` returns with the run id; `runs show -f` follows it;
    `runs cancel` leaves a checkpoint the server has and a cancelled run; the printed resume
    command continues from that checkpoint."""
    import tinker

    run_dir = tmp_path / "detached"
    started = subprocess.run(
        [*train_argv(server, tiny_model, "-", run_dir, "--batch-size", "2", "--epochs", "40"),
         "--detach", "--json"],
        input=chats.read_text(), env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    info = as_json(started)
    assert info["id"] == "detached" and info["run_dir"] == str(run_dir.resolve())
    assert Path(info["log"]).is_file() and (run_dir / "dataset.jsonl").is_file()
    follow = subprocess.Popen(
        [*RLCLI, "runs", "show", "detached", "-f", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(
            lambda: steps_logged(run_dir) >= 2, timeout=120, what="two steps of the detached run"
        )
        cancelled = as_json(rlcli(env, "runs", "cancel", "detached", "--json"))
        out, err = follow.communicate(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert cancelled["status"] == "cancelled"
    done = cancelled["steps_done"]
    checkpoint = cancelled["checkpoint"]
    assert checkpoint["cancelled"] is True and checkpoint["epoch"] == 0
    assert checkpoint["batch"] == done  # the batch that comes next
    rows = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert rows[-1] == checkpoint
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-dummy")
    for key in ("state_path", "sampler_path"):
        assert rest.get_weights_info_by_tinker_path(checkpoint[key]).result().base_model

    assert follow.returncode == 4, err[-2000:]  # the follower exits with the run's outcome
    assert "following detached" in err and "run detached cancelled" in err
    assert json.loads(out)["status"] == "cancelled"
    listed = {r["id"]: r for r in as_json(rlcli(env, "runs", "list", "--json"))}
    assert listed["detached"]["status"] == "cancelled" and listed["detached"]["exit_code"] == 4
    log = Path(info["log"]).read_text()
    assert log.rstrip().splitlines()[-1].startswith("cancelled (rlcli runs cancel) after step ")
    assert "error:" not in log  # a cancel is what was asked for, not an error
    assert sum(1 for r in rows if r["name"] == checkpoint["name"]) == 1  # one row each

    resume = cancelled["resume"].split()
    assert resume[:3] == ["rlcli", "train", "sl"]
    resumed = rlcli(env, *resume[1:], "--max-steps", str(done + 1), "--json")  # ends by itself
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps == list(range(done + 1))  # continued at the step after the checkpoint
    assert f"resuming in {run_dir.resolve()}" in resumed.stderr or "resuming" in resumed.stderr
    again = as_json(rlcli(env, "runs", "show", "detached", "--json"))
    assert again["status"] == "finished" and again["steps_done"] == done + 1


@pytest.mark.slow
def test_folders_without_a_record_and_ambiguous_ids(runs, env, home, tmp_path):
    """A folder from before rlcli_run.json lists from what its files say; two runs with one
    name are one clear line asking for the path."""
    import shutil

    legacy = home / "runs" / "legacy"
    shutil.copytree(runs["finished"], legacy, ignore=shutil.ignore_patterns("rlcli_run.json"))
    crashed = home / "runs" / "legacy-failed"
    shutil.copytree(runs["failed"], crashed, ignore=shutil.ignore_patterns("rlcli_run.json"))
    with (crashed / "console.log").open("a") as f:
        f.write("rlcli-error: the run failed with RuntimeError: boom\n")
    listed = {r["id"]: r for r in as_json(rlcli(env, "runs", "list", "--json"))}
    assert listed["legacy"]["status"] == "finished" and listed["legacy"]["steps_done"] == 3
    assert listed["legacy"]["total_steps"] == 3 and listed["legacy"]["kind"] == "sl"
    assert listed["legacy-failed"]["status"] == "failed"
    assert listed["legacy-failed"]["error"] == "the run failed with RuntimeError: boom"

    twin = tmp_path / runs["killed"].name
    shutil.copytree(runs["killed"], twin)
    with (home / "runs" / "index.txt").open("a") as f:
        f.write(f"{twin}\n")
    ambiguous = rlcli(env, "runs", "show", runs["killed"].name)
    assert ambiguous.returncode == 1 and ambiguous.stderr.count("\n") == 1
    assert "is ambiguous" in ambiguous.stderr and str(twin) in ambiguous.stderr
    assert as_json(rlcli(env, "runs", "show", str(twin), "--json"))["run_dir"] == str(twin)

"""What `rlcli train` does when things go wrong mid-run, on a real server with the tiny model:
the server dies, the user presses Ctrl-C or closes the terminal, a supervisor sends SIGTERM,
`rlcli` itself is killed, the output pipe closes, a second command targets the same run folder.
Each must stop the recipe child (never an orphan), exit with the right code, and say in one line
how to resume."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import RLCLI, cli, recipe_children, start_server, wait_for_steps

EXAMPLES = Path(__import__("tinker_cookbook").__file__).parent / "example_data"


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text((EXAMPLES / "conversations.jsonl").read_text())
    return path


def long_run(url: str, model: Path, chats: Path, run_dir: Path) -> list[str]:
    """A run of a few hundred short steps: long enough to interrupt anywhere."""
    return [
        *RLCLI, "train", "sl", "--dataset", str(chats), "--model", str(model),
        "--base-url", url, "--log-path", str(run_dir), "--batch-size", "2", "--epochs", "4",
        "--save-every", "2", "--lora-rank", "4",
    ]  # fmt: skip


def start(argv, run_dir: Path, **popen) -> tuple[subprocess.Popen, Path]:
    err = run_dir.parent / f"{run_dir.name}.stderr"
    popen.setdefault("stdout", subprocess.PIPE)
    proc = subprocess.Popen(argv, stderr=err.open("w"), text=True, **popen)
    return proc, err


def wait_gone(run_dir: Path, timeout=15) -> list[int]:
    deadline = time.monotonic() + timeout
    while recipe_children(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    return recipe_children(run_dir)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def lock_is_free(run_dir: Path, timeout: float = 5.0) -> bool:
    """The run folder's flock can be taken (waiting a moment for killed holders to be gone)."""
    deadline = time.monotonic() + timeout
    while True:
        fd = os.open(run_dir / "rlcli.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holders = [
                    f"{p} {Path(f'/proc/{p}/cmdline').read_bytes()[:200]!r}"
                    for p in os.listdir("/proc")
                    if p.isdigit() and _holds(int(p), run_dir / "rlcli.lock")
                ]
                print("lock holders:", holders)
                return False
        finally:
            os.close(fd)
        time.sleep(0.2)


def _holds(pid: int, path: Path) -> bool:
    try:
        return any(
            os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")
        )
    except OSError:
        return False


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_server_that_dies_mid_run_is_noticed_and_named(tmp_path, tiny_model, chats, how):
    home = tmp_path / "srv"
    record = start_server(home, tiny_model)
    run_dir = tmp_path / "run"
    # The health watch's real intervals (5 s, 4 s timeouts) made this wait ~40 s for a frozen
    # server; the same three failed checks in a row, shortened (runner.HEALTH_*_S).
    quick = {**os.environ, "RLCLI_HEALTH_EVERY_S": "0.5", "RLCLI_HEALTH_TIMEOUT_S": "2"}
    argv = long_run(record.base_url, tiny_model, chats, run_dir)
    proc, err = start(argv, run_dir, env=quick)
    try:
        wait_for_steps(run_dir, 3, proc)
        assert recipe_children(run_dir)
        # killed: nothing listens any more; frozen (SIGSTOP): connections hang unanswered
        os.killpg(record.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        stopped = time.monotonic()
        code = proc.wait(timeout=120)
        noticed = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
        if how == "frozen":
            os.killpg(record.pid, signal.SIGKILL)
            os.killpg(record.pid, signal.SIGCONT)
    stderr = err.read_text()
    print(f"noticed the {how} server in {noticed:.1f}s")
    assert code == 1 and noticed < 60
    errors = error_lines(stderr)
    assert len(errors) == 1, stderr[-2000:]
    line = errors[0]
    assert f"the server at {record.base_url} stopped answering" in line
    assert ("Timeout" in line) == (how == "frozen")
    assert "Resume with: " in line and f"--log-path {run_dir}" in line
    assert line.split("Resume with: ")[1].startswith("rlcli train sl ")
    assert "Traceback" not in stderr
    assert wait_gone(run_dir) == []
    assert lock_is_free(run_dir)


@pytest.mark.parametrize(
    "sig, code",
    [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_signals_stop_the_recipe_and_print_the_resume_command(
    tmp_path, server, tiny_model, chats, sig, code
):
    run_dir = tmp_path / "run"
    proc, err = start(long_run(server.base_url, tiny_model, chats, run_dir), run_dir)
    try:
        wait_for_steps(run_dir, 2, proc)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == code
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = err.read_text()
    errors = error_lines(stderr)
    assert len(errors) == 1 and "stopped the run. " in errors[0]
    # Resume from the last checkpoint, or (none saved yet) the same command starts over
    assert "Resume with: rlcli train sl" in errors[0] or "starts over" in errors[0]
    assert "Traceback" not in stderr
    assert wait_gone(run_dir, timeout=5) == []


def test_a_killed_rlcli_takes_its_recipe_with_it_and_frees_the_folder(
    tmp_path, server, tiny_model, chats
):
    run_dir = tmp_path / "run"
    proc, _ = start(long_run(server.base_url, tiny_model, chats, run_dir), run_dir)
    try:
        wait_for_steps(run_dir, 2, proc)
        children = recipe_children(run_dir)
        assert len(children) == 1
        proc.kill()  # SIGKILL: no handler runs; the kernel kills the child (PR_SET_PDEATHSIG)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_gone(run_dir, timeout=10) == []
    assert lock_is_free(run_dir)  # flock died with both processes
    rows = len((run_dir / "metrics.jsonl").read_text().splitlines())
    time.sleep(2)
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == rows  # nobody writes


def test_a_closed_output_pipe_stops_the_recipe(tmp_path, server, tiny_model, chats):
    import shlex

    run_dir = tmp_path / "run"
    argv = long_run(server.base_url, tiny_model, chats, run_dir)
    began = time.monotonic()
    result = subprocess.run(
        ["bash", "-c", f"{shlex.join(argv)} 2>&1 | head -n 6; echo ${{PIPESTATUS[0]}}"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    took = time.monotonic() - began
    assert result.stdout.splitlines()[-1] == "141"  # rlcli's own exit: SIGPIPE's code
    assert len(result.stdout.splitlines()) == 7 and took < 120
    assert wait_gone(run_dir, timeout=5) == []


def test_a_second_command_on_a_running_folder_names_the_pid(tmp_path, server, tiny_model, chats):
    run_dir = tmp_path / "run"
    argv = long_run(server.base_url, tiny_model, chats, run_dir)
    proc, _ = start(argv, run_dir)
    try:
        wait_for_steps(run_dir, 1, proc)
        second = cli(*argv[len(RLCLI) :])  # in this process: the lock is per process
        assert second.returncode == 1
        errors = error_lines(second.stderr)
        assert len(errors) == 1, second.stderr
        assert (
            f"run folder {run_dir} is in use by another rlcli command (pid {proc.pid})"
            in (errors[0])
        )
        assert proc.poll() is None  # the first run goes on
        proc.kill()  # kill -9: the lock must not outlive the run
        proc.wait()
        assert wait_gone(run_dir, timeout=10) == []
        assert lock_is_free(run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_progress_on_a_terminal_is_a_bar_with_phases(tmp_path, server, tiny_model, chats):
    import pty
    import select

    run_dir = tmp_path / "run"
    argv = [
        *RLCLI, "train", "sl", "--dataset", str(chats), "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(run_dir), "--batch-size", "16",
        "--max-steps", "4", "--lora-rank", "4", "--test-size", "0.1",
    ]  # fmt: skip
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=follower, stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    screen = b""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the command is done
                break
            if not chunk:
                break
            screen += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    assert proc.wait(timeout=30) == 0, screen.decode(errors="replace")[-3000:]
    text = screen.decode(errors="replace")
    assert "\x1b[" in text  # drawn with terminal control sequences, not plain lines
    assert "━" in text  # Rich's bar
    assert "4/4" in text and "loss" in text
    assert "evaluating the held-out loss" in text  # what the last seconds are spent on
    assert "step 1/4" not in text  # the plain-lines mode stayed off


def test_plain_progress_rates_are_sane_and_the_end_is_narrated(tmp_path, server, tiny_model, chats):
    import re

    run_dir = tmp_path / "run"
    argv = [
        *RLCLI, "train", "sl", "--dataset", str(chats), "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(run_dir), "--batch-size", "8",
        "--max-steps", "8", "--lora-rank", "4", "--save-every", "4", "--test-size", "0.1",
    ]  # fmt: skip
    result = cli(*argv[len(RLCLI) :])  # in this process: stderr is not a terminal either
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == [f"{i}/8" for i in range(1, 9)]
    for line in steps:
        rate = re.search(r"(\d+) tok/s", line)
        if rate:  # the tiny model on 2 shared cores: a few thousand tokens/s at most
            assert 10 < int(rate.group(1)) < 50_000, line
    assert not any("eta 0s" in ln for ln in steps[:-1])
    assert "tok/s" not in steps[0]  # nothing to measure a rate over yet
    starting = next(i for i, ln in enumerate(lines) if ln.startswith("starting"))
    assert starting < lines.index(steps[0])  # shown from the first second
    after = lines[lines.index(steps[-1]) + 1 :]
    assert any("saving final checkpoint" in ln for ln in after)
    assert any("evaluating the held-out loss" in ln for ln in after)
    # --save-every 4: checkpoints after 4 and 8 steps, named so, shown as step 4 (one count)
    assert any(ln.startswith("saving checkpoint (step 4)") for ln in lines)
    rows = (run_dir / "checkpoints.jsonl").read_text().splitlines()
    names = [json.loads(r)["name"] for r in rows]
    assert names == ["000004", "000008", "final"]

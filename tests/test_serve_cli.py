"""The `rlcli serve start / status / logs / stop` lifecycle, run as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RLCLI, cli, run_rlcli
from rlcli.demo.run import free_port
from rlcli.launch.pids import pid_alive


def rlcli(home, *args, timeout=180) -> subprocess.CompletedProcess:
    """`rlcli ARGS` as a user runs it: a process of its own (each `serve start` here)."""
    return run_rlcli(*args, env={"RLCLI_HOME": str(home)}, timeout=timeout)


def quick(home, *args) -> subprocess.CompletedProcess:
    """`rlcli ARGS` in this process (conftest.cli): status, logs, stop and refusals."""
    return cli(*args, env={"RLCLI_HOME": str(home)})


@pytest.fixture
def home(tmp_path):
    yield tmp_path
    quick(tmp_path, "serve", "stop", "--grace", "2")  # never leave a server behind


def test_start_status_logs_stop(home, tiny_model):
    port = free_port()
    started = rlcli(
        home, "serve", "start", "--base-model", str(tiny_model), "--port", str(port),
        "--no-compile",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == f"http://127.0.0.1:{port}"
    assert f"OpenAI-compatible API: http://127.0.0.1:{port}/v1" in started.stderr

    status = quick(home, "serve", "status", "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert info["running"] and info["healthy"]
    assert info["port"] == port and info["backend"] == "torch"
    assert info["base_model"] == str(tiny_model)
    assert info["pid"] > 0 and info["uptime_s"] >= 0
    assert info["device"] == "cpu"
    assert info["decode_step"] == "rlcli llama step" and info["compile"] == "off"

    again = quick(home, "serve", "start", "--base-model", str(tiny_model), "--port", str(port))
    assert again.returncode == 1
    assert "already running" in again.stderr and f"pid {info['pid']}" in again.stderr

    logs = quick(home, "serve", "logs", "-n", "5")
    assert logs.returncode == 0 and "engine ready" in (home / "logs" / "server.log").read_text()

    stopped = quick(home, "serve", "stop")
    assert stopped.returncode == 0 and "stopped the server" in stopped.stderr
    assert not pid_alive(info["pid"])
    after = quick(home, "serve", "status", "--json")
    assert after.returncode == 3 and json.loads(after.stdout) == {"running": False}


def test_stop_when_nothing_runs_says_so(home):
    result = quick(home, "serve", "stop")
    assert result.returncode == 0
    assert "no server is running; nothing to stop" in result.stderr


def test_port_already_taken_is_a_clear_error(home, tiny_model):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = quick(home, "serve", "start", "--base-model", str(tiny_model), "--port", str(port))
    assert result.returncode == 1
    assert f"error: port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "--port" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (home / "server.json").exists()


def test_status_cleans_up_after_a_killed_server(home, tiny_model):
    port = free_port()
    started = rlcli(home, "serve", "start", "--base-model", str(tiny_model), "--port", str(port))
    assert started.returncode == 0, started.stderr
    pid = json.loads((home / "server.json").read_text())["pid"]
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    status = quick(home, "serve", "status", "--json")
    assert status.returncode == 3
    assert json.loads(status.stdout) == {"running": False, "cleaned_up_stale_pid": pid}
    assert not (home / "server.json").exists()


def test_missing_model_folder_is_a_clear_error(home, tmp_path):
    result = quick(home, "serve", "start", "--base-model", str(tmp_path / "nope"))
    assert result.returncode == 1
    assert "--base-model" in result.stderr and "no such folder" in result.stderr


def test_unknown_flag_and_backend_are_refused(home, tiny_model):
    result = quick(home, "serve", "start", "--base-model", str(tiny_model), "--backend", "tpu")
    assert result.returncode == 1 and "--backend tpu: unknown backend" in result.stderr
    result = quick(home, "serve", "start", "--bogus")
    assert result.returncode == 2 and result.stderr.count("\n") == 1  # one line, no usage box
    assert "rlcli serve start: No such option: --bogus" in result.stderr
    result = quick(home, "serve", "strat")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "rlcli serve: No such command 'strat'. Did you mean 'start', 'status'?" in result.stderr
    result = quick(
        home, "serve", "start", "--base-model", str(tiny_model), "--backend", "jax", "--no-compile"
    )
    assert result.returncode == 1 and "--no-compile: only for --backend torch" in result.stderr


def test_help_is_fast_and_does_not_import_torch(home):
    code = "import sys; from rlcli.cli.main import app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False"
    result = quick(home, "--help")
    assert result.returncode == 0 and "serve" in result.stdout


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (to prove nothing was left running)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if text.encode() in cmdline and pid_alive(int(entry)):
                pids.append(int(entry))
    return pids


def test_the_same_port_starts_again_right_after_a_kill_9(home, tiny_model):
    port = free_port()
    started = rlcli(home, "serve", "start", "--base-model", str(tiny_model), "--port", str(port))
    assert started.returncode == 0, started.stderr
    pid = json.loads((home / "server.json").read_text())["pid"]
    # An open keep-alive connection makes the kernel's close of the killed server's socket
    # an active close: the port sits in TIME_WAIT, as after a crash under load.
    import httpx

    with httpx.Client() as client:
        assert client.get(f"http://127.0.0.1:{port}/api/v1/healthz").status_code == 200
        os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    with socket.socket() as plain, pytest.raises(OSError):  # what the old check tripped over
        plain.bind(("127.0.0.1", port))
    again = rlcli(home, "serve", "start", "--base-model", str(tiny_model), "--port", str(port))
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"http://127.0.0.1:{port}"


def test_stop_never_signals_a_pid_that_is_no_longer_our_server(home):
    # A record whose pid now belongs to an unrelated process (pid reuse after a crash).
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        record = {
            "pid": bystander.pid, "host": "127.0.0.1", "port": free_port(),
            "base_model": "x", "backend": "torch", "log_path": str(home / "log"),
            "start_ticks": 1,  # not the bystander's start time
        }  # fmt: skip
        (home / "server.json").write_text(json.dumps(record))
        stopped = quick(home, "serve", "stop", "--grace", "1")
        assert stopped.returncode == 0
        assert f"stale record of pid {bystander.pid}" in stopped.stderr
        assert "nothing was signalled" in stopped.stderr
        time.sleep(0.3)
        assert bystander.poll() is None  # still running: never signalled
        assert not (home / "server.json").exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_status_exits_nonzero_when_the_server_is_not_healthy(home):
    # A live process recorded as the server, with nothing answering on its port.
    from rlcli.launch.pids import start_ticks

    impostor = subprocess.Popen(["sleep", "60"])
    try:
        record = {
            "pid": impostor.pid, "host": "127.0.0.1", "port": free_port(),
            "base_model": "x", "backend": "torch", "log_path": str(home / "log"),
            "start_ticks": start_ticks(impostor.pid),
        }  # fmt: skip
        (home / "server.json").write_text(json.dumps(record))
        status = quick(home, "serve", "status", "--json")
        assert status.returncode == 1
        info = json.loads(status.stdout)
        assert info["running"] and not info["healthy"]
    finally:
        impostor.kill()
        impostor.wait()
        (home / "server.json").unlink(missing_ok=True)


@pytest.mark.parametrize("damage", ["corrupt weights", "unloadable config"])
def test_a_server_that_cannot_load_fails_start_and_leaves_nothing(
    home, tiny_model, tmp_path, damage
):
    import shutil

    broken = home / "broken-model"
    shutil.copytree(tiny_model, broken)
    if damage == "corrupt weights":
        for weights in broken.glob("*.safetensors"):
            weights.write_bytes(b"\x00garbage, not a safetensors file" * 64)
    else:
        config = json.loads((broken / "config.json").read_text())
        config["model_type"] = "no_such_architecture"
        (broken / "config.json").write_text(json.dumps(config))
    port = free_port()
    began = time.monotonic()
    result = rlcli(
        home, "serve", "start", "--base-model", str(broken), "--port", str(port), "--wait", "120"
    )
    took = time.monotonic() - began
    assert result.returncode == 1, result.stderr
    assert took < 60  # noticed when the engine failed, not at the end of --wait
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "failed while starting" in errors[0], result.stderr
    assert result.stderr.strip().splitlines()[-1] == errors[0]  # one line, nothing after it
    assert "Traceback" not in result.stderr
    assert not (home / "server.json").exists()
    assert not _listening(port)
    assert _processes_mentioning(str(broken)) == []


def test_start_gives_up_after_wait_and_leaves_nothing(home, tiny_model):
    port = free_port()
    result = rlcli(
        home,
        "serve",
        "start",
        "--base-model",
        str(tiny_model),
        "--port",
        str(port),
        "--wait",
        "0.2",
    )
    assert result.returncode == 1
    assert "did not become healthy within --wait 0.2s" in result.stderr
    assert not (home / "server.json").exists()
    time.sleep(0.5)
    assert not _listening(port) and _processes_mentioning(f"--port {port}") == []


def test_a_foreground_server_is_seen_by_status_logs_and_stop(home, tiny_model):
    port = free_port()
    command = [*RLCLI, "serve", "start", "--foreground", "--base-model", str(tiny_model)]
    proc = subprocess.Popen(
        [*command, "--port", str(port)],
        env={**os.environ, "RLCLI_HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            status = quick(home, "serve", "status", "--json")
            if status.returncode == 0:
                break
            time.sleep(0.5)
        assert status is not None and status.returncode == 0, status and status.stdout
        info = json.loads(status.stdout)
        assert info["pid"] == proc.pid and info["port"] == port and info["healthy"]
        logs = quick(home, "serve", "logs", "-n", "200")
        assert "engine ready" in logs.stdout
        stopped = quick(home, "serve", "stop")
        assert stopped.returncode == 0 and f"stopped the server (pid {proc.pid}" in stopped.stderr
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        out = proc.stdout.read()
        assert b"engine ready" in out  # the log also reached stdout
        # SIGTERM (what stop sends) ends it cleanly: uvicorn shuts down gracefully, then
        # re-raises the signal it caught (uvicorn >= 0.29). Was test_server_behaviour's own.
        assert b"Traceback" not in out
        assert not (home / "server.json").exists()
        assert not _listening(port)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_killed_foreground_cli_takes_its_server_with_it(home, tiny_model):
    port = free_port()
    command = [*RLCLI, "serve", "start", "--foreground", "--base-model", str(tiny_model)]
    proc = subprocess.Popen(
        [*command, "--port", str(port)],
        env={**os.environ, "RLCLI_HOME": str(home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not _listening(port):
        time.sleep(0.3)
    assert _listening(port)
    proc.kill()  # SIGKILL: no handler runs; the kernel tells the server (PR_SET_PDEATHSIG)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _listening(port):
        time.sleep(0.3)
    assert not _listening(port)
    status = quick(home, "serve", "status", "--json")
    assert status.returncode == 3  # the stale record is cleaned up

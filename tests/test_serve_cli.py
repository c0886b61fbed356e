"""The `rlcli serve start / status / logs / stop` lifecycle, run as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import run_rlcli
from rlcli.backends.process import pid_alive
from rlcli.demo import free_port


def rlcli(home, *args, timeout=180) -> subprocess.CompletedProcess:
    return run_rlcli(*args, env={"RLCLI_HOME": str(home)}, timeout=timeout)


@pytest.fixture
def home(tmp_path):
    yield tmp_path
    rlcli(tmp_path, "serve", "stop", "--grace", "2")  # never leave a server behind


def test_start_status_logs_stop(home, tiny_model):
    port = free_port()
    started = rlcli(home, "serve", "start", "--base-model", str(tiny_model), "--port", str(port))
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == f"http://127.0.0.1:{port}"

    status = rlcli(home, "serve", "status", "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert info["running"] and info["healthy"]
    assert info["port"] == port and info["backend"] == "torch"
    assert info["base_model"] == str(tiny_model)
    assert info["pid"] > 0 and info["uptime_s"] >= 0
    assert info["device"] == "cpu"

    again = rlcli(home, "serve", "start", "--base-model", str(tiny_model), "--port", str(port))
    assert again.returncode == 1
    assert "already running" in again.stderr and f"pid {info['pid']}" in again.stderr

    logs = rlcli(home, "serve", "logs", "-n", "5")
    assert logs.returncode == 0 and "engine ready" in (home / "logs" / "server.log").read_text()

    stopped = rlcli(home, "serve", "stop")
    assert stopped.returncode == 0 and "stopped the server" in stopped.stderr
    assert not pid_alive(info["pid"])
    after = rlcli(home, "serve", "status", "--json")
    assert after.returncode == 3 and json.loads(after.stdout) == {"running": False}


def test_stop_when_nothing_runs_says_so(home):
    result = rlcli(home, "serve", "stop")
    assert result.returncode == 0
    assert "no server is running; nothing to stop" in result.stderr


def test_port_already_taken_is_a_clear_error(home, tiny_model):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = rlcli(home, "serve", "start", "--base-model", str(tiny_model), "--port", str(port))
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
    status = rlcli(home, "serve", "status", "--json")
    assert status.returncode == 3
    assert json.loads(status.stdout) == {"running": False, "cleaned_up_stale_pid": pid}
    assert not (home / "server.json").exists()


def test_missing_model_folder_is_a_clear_error(home, tmp_path):
    result = rlcli(home, "serve", "start", "--base-model", str(tmp_path / "nope"))
    assert result.returncode == 1
    assert "--base-model" in result.stderr and "no such folder" in result.stderr


def test_unknown_flag_and_backend_are_refused(home, tiny_model):
    result = rlcli(home, "serve", "start", "--base-model", str(tiny_model), "--backend", "tpu")
    assert result.returncode == 1 and "--backend tpu: unknown backend" in result.stderr
    result = rlcli(home, "serve", "start", "--bogus")
    assert result.returncode == 2 and "No such option" in result.stderr


def test_help_is_fast_and_does_not_import_torch(home):
    code = "import sys; from rlcli.cli.main import app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False"
    result = rlcli(home, "--help")
    assert result.returncode == 0 and "serve" in result.stdout


def test_demo_trains_through_a_real_server_and_cleans_up(home):
    result = rlcli(home, "demo", "--steps", "4", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["steps"] == 4 and summary["last_loss"] < summary["first_loss"]
    assert "server stopped" in result.stderr
    assert not (home / "demo" / "server.json").exists()

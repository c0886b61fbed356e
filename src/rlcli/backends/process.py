"""Starting, watching and stopping a detached server process, whatever its backend.

State lives in ``<home>/server.json`` (pid, port, model, backend, log path); the log in
``<home>/logs/server.log``. One managed server per home: tests and the demo use their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from rlcli.errors import RlcliError


@dataclass
class ServerRecord:
    pid: int
    host: str
    port: int
    base_model: str
    backend: str
    log_path: str
    started_at: float = field(default_factory=time.time)
    command: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


def state_path(home: Path) -> Path:
    return home / "server.json"


def log_path(home: Path) -> Path:
    return home / "logs" / "server.log"


def read_record(home: Path) -> ServerRecord | None:
    try:
        return ServerRecord(**json.loads(state_path(home).read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def _write_record(home: Path, record: ServerRecord) -> None:
    path = state_path(home)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) still answers kill(0).
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def live_record(home: Path) -> tuple[ServerRecord | None, ServerRecord | None]:
    """(running record, stale record that was just cleaned up)."""
    record = read_record(home)
    if record is None:
        return None, None
    if pid_alive(record.pid):
        return record, None
    state_path(home).unlink(missing_ok=True)
    return None, record


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as e:
            raise RlcliError(
                f"port {port} on {host} is already in use ({e.strerror}); "
                "choose another with --port"
            ) from None


def health(base_url: str, timeout: float = 2.0) -> tuple[bool, str]:
    """(healthy, detail) from ``/api/v1/healthz``."""
    try:
        response = httpx.get(f"{base_url}/api/v1/healthz", timeout=timeout)
    except httpx.HTTPError as e:
        return False, f"no answer ({type(e).__name__})"
    if response.status_code == 200:
        return True, "ok"
    with contextlib.suppress(Exception):
        return False, str(response.json().get("detail", response.status_code))
    return False, f"HTTP {response.status_code}"


def tail(path: Path, lines: int) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return text.splitlines()[-lines:] if lines > 0 else []


def start_detached(
    home: Path,
    command: list[str],
    *,
    host: str,
    port: int,
    base_model: str,
    backend: str,
    wait: float,
    env: dict[str, str] | None = None,
) -> tuple[ServerRecord, bool]:
    """Spawn ``command`` in its own session, record it, wait up to ``wait`` s for health.

    Returns (record, healthy). Raises ``RlcliError`` if a server already runs here, the port is
    taken, or the process dies while starting (with the tail of its log).
    """
    running, _ = live_record(home)
    if running is not None:
        raise RlcliError(
            f"a server is already running here (pid {running.pid}, {running.base_url}, "
            f"model {running.base_model}); stop it with `rlcli serve stop`"
        )
    check_port_free(host, port)
    log = log_path(home)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"\n==== rlcli serve start {time.strftime('%Y-%m-%d %H:%M:%S')}: ")
        out.write(" ".join(command) + "\n")
        out.flush()
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives this CLI; stop signals its whole group
            env={**os.environ, **(env or {})},
        )
    record = ServerRecord(
        pid=process.pid,
        host=host,
        port=port,
        base_model=base_model,
        backend=backend,
        log_path=str(log),
        command=command,
    )
    _write_record(home, record)
    deadline = time.monotonic() + wait
    while True:
        exit_code = process.poll()
        if exit_code is not None:
            state_path(home).unlink(missing_ok=True)
            last = "\n  ".join(tail(log, 15))
            raise RlcliError(
                f"the server exited while starting (exit code {exit_code}); "
                f"last lines of {log}:\n  {last}"
            )
        healthy, _ = health(record.base_url, timeout=1.0)
        if healthy:
            return record, True
        if time.monotonic() >= deadline:
            return record, False
        time.sleep(0.3)


def stop(home: Path, grace: float = 15.0) -> tuple[ServerRecord | None, str]:
    """Stop the recorded server: SIGTERM to its process group, SIGKILL after ``grace`` s.

    Returns (record or None, how it ended: "stopped" | "killed" | "not running" | "stale").
    """
    record, stale = live_record(home)
    if record is None:
        return stale, "stale" if stale else "not running"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record.pid, signal.SIGTERM)
    how = "stopped"
    deadline = time.monotonic() + grace
    while pid_alive(record.pid):
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record.pid, signal.SIGKILL)
            how = "killed"
            time.sleep(0.2)
            break
        time.sleep(0.1)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(record.pid, os.WNOHANG)
    state_path(home).unlink(missing_ok=True)
    return record, how

"""Starting, watching and stopping a server process, whatever its backend.

State lives in ``<home>/server.json`` (pid, the pid's start time, port, model, backend, log
path); the log in ``<home>/logs/server.log``. One managed server per home: tests and the demo
use their own. A detached server (``start_detached``) runs in its own session and outlives the
CLI; a foreground one (``run_foreground``) is a child of the CLI that dies with it. Both are
recorded the same way, so ``serve status | stop | logs`` see either.

A recorded pid is only trusted while ``/proc/<pid>/stat`` still shows the start time recorded
with it, in the same boot (``/proc/sys/kernel/random/boot_id``): after a crash and a reboot (or
pid reuse) the same number, even with the same start time, can belong to an unrelated process.
Invariant: ``stop`` signals only processes it started: the server's own pid while it is the
recorded process, its session and tree while it leads them, and, once it is gone, only the
members recorded in ``server.json`` (pid + start time, same boot), never whatever now has a
session id equal to the old pid (a nohup job whose session leader exited can).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from rlcli.errors import RlcliError
from rlcli.files import atomic, lastline
from rlcli.launch import pids

LOADING = "loading the base model"  # what /api/v1/healthz says while the engine starts


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
    # /proc/<pid>/stat field 22 (clock ticks after boot): pid + start time name one process.
    start_ticks: int | None = None
    foreground: bool = False  # the pid is an `rlcli serve start --foreground` process
    boot_id: str | None = None  # the boot it ran in: pids and start times mean nothing after
    # Its session and tree once it was up ({pid: start ticks}): what a stop may end after the
    # server's own process has gone.
    members: dict[str, int | None] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


@dataclass
class Launch:
    """A server to start: its command line, and what its record will say about it."""

    command: list[str]
    host: str
    port: int
    base_model: str
    backend: str
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment

    def record(self, pid: int, log: Path, *, foreground: bool = False) -> ServerRecord:
        """The record of ``pid`` running this launch (its start time and boot named)."""
        return ServerRecord(
            pid=pid,
            host=self.host,
            port=self.port,
            base_model=self.base_model,
            backend=self.backend,
            log_path=str(log),
            command=self.command,
            start_ticks=pids.start_ticks(pid),
            foreground=foreground,
            boot_id=pids.boot_id(),
        )


def state_path(home: Path) -> Path:
    return home / "server.json"


def log_path(home: Path) -> Path:
    return home / "logs" / "server.log"


def read_record(home: Path) -> ServerRecord | None:
    try:
        data = json.loads(state_path(home).read_text())
        known = {f.name for f in dataclasses.fields(ServerRecord)}
        return ServerRecord(**{k: v for k, v in data.items() if k in known})
    except (FileNotFoundError, json.JSONDecodeError, TypeError, AttributeError):
        return None


def _write_record(home: Path, record: ServerRecord) -> None:
    atomic.write_text(state_path(home), json.dumps(asdict(record), indent=2) + "\n")


def _remove_record_of(home: Path, pid: int) -> None:
    """Remove the record only if it is still the one for ``pid`` (another may have replaced it)."""
    record = read_record(home)
    if record is not None and record.pid == pid:
        state_path(home).unlink(missing_ok=True)


def is_ours(record: ServerRecord) -> bool:
    """The recorded pid is alive and is still the process that was recorded (same boot, same
    start time)."""
    if record.boot_id is not None and record.boot_id != pids.boot_id():
        return False  # another boot: whatever has that pid now is not ours
    if not pids.pid_alive(record.pid):
        return False
    if record.start_ticks is None:  # a record from before start times were kept
        return True
    return pids.start_ticks(record.pid) == record.start_ticks


def live_record(home: Path) -> tuple[ServerRecord | None, ServerRecord | None]:
    """(running record, stale record that was just cleaned up)."""
    record = read_record(home)
    if record is None:
        return None, None
    if is_ours(record):
        return record, None
    state_path(home).unlink(missing_ok=True)
    return None, record


def is_loopback(host: str) -> bool:
    """``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, insecure: bool, takes_key: bool = True) -> None:
    """Invariant: a server reachable from other machines needs a key. Binding anything but
    loopback without ``--api-key`` is refused with one line, unless ``--insecure`` says the
    exposure is meant; a backend that takes no key (SkyRL) is told how to put one in front."""
    if insecure or is_loopback(host) or (takes_key and api_key):
        return
    if takes_key:
        raise RlcliError(
            f"--host {host}: other machines could reach this server, and without --api-key "
            "anyone there can train, sample and download checkpoints; pass --api-key tml-... "
            "(clients send it as TINKER_API_KEY), or --insecure to expose it without a key"
        )
    raise RlcliError(
        f"--host {host}: SkyRL's server takes no API key, so anyone who reaches it can use it; "
        "keep the default --host 127.0.0.1 and put a key in front of it (an SSH tunnel, or a "
        "reverse proxy that checks X-API-Key), or pass --insecure to expose it as it is"
    )


def check_port(port: int, flag: str = "--port") -> None:
    """A TCP port a server can listen on and a client can name: 1-65535. Port 0 would bind a
    random port the record could not name; a larger one overflows ``bind``."""
    if not 1 <= port <= 65535:
        raise RlcliError(f"{flag} {port}: not a TCP port; choose one from 1 to 65535")


def check_port_free(host: str, port: int) -> None:
    """Fail if something listens on ``host:port``.

    SO_REUSEADDR, as uvicorn sets it: without it a port in TIME_WAIT after a stop or a crash
    looks taken for a minute although the server itself could bind it. On Linux a port with a
    live listener still refuses the bind.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def last_start_offset(path: Path) -> int:
    """Where the last ``rlcli serve start`` section of the log begins (0 if none)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    return max(0, data.rfind(b"\n==== rlcli serve start"))


def last_error_line(path: Path, offset: int = 0, fallback: bool = True) -> str | None:
    """The last line of the log (from byte ``offset``) that names an error; else the last line,
    or None when ``fallback`` is false (a server killed from outside logs no error)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log)" if fallback else None
    text = "\n".join(ln for ln in text.splitlines() if not ln.strip().startswith("===="))
    found = lastline.last_error_line(text)
    if found is not None or not fallback:
        return found
    return lastline.last_line(text, 400) or "(the log is empty)"


def remember_family(home: Path, record: ServerRecord) -> None:
    """Record the server's session and tree now (it is up), so a stop after its own process
    died ends exactly these and nothing that merely shares the old session id."""
    record.members = {str(p): ticks for p, ticks in pids.family(record.pid).items()}
    on_disk = read_record(home)
    if on_disk is not None and on_disk.pid == record.pid and is_ours(record):
        _write_record(home, record)


def recorded_members(record: ServerRecord) -> dict[int, int | None]:
    """The members a record names, if it was written in this boot (else none are ours)."""
    if record.boot_id is None or record.boot_id != pids.boot_id():
        return {}
    return {int(p): ticks for p, ticks in record.members.items() if ticks is not None}


def engine_error(base_url: str) -> str | None:
    """The error a server reports once its engine has failed (``None`` while fine or loading)."""
    healthy, detail = health(base_url, timeout=1.0)
    if healthy or detail.startswith("no answer") or detail == LOADING:
        return None
    return detail


def _prepare_start(home: Path, host: str, port: int) -> Path:
    """Refuse a second server here or a taken port; the log file to append to."""
    running, _ = live_record(home)
    if running is not None:
        raise RlcliError(
            f"a server is already running here (pid {running.pid}, {running.base_url}, "
            f"model {running.base_model}); stop it with `rlcli serve stop`"
        )
    check_port_free(host, port)
    log = log_path(home)
    log.parent.mkdir(parents=True, exist_ok=True)
    return log


def start_detached(home: Path, launch: Launch, *, wait: float) -> tuple[ServerRecord, bool]:
    """Spawn ``launch.command`` in its own session, record it, wait up to ``wait`` s for health.

    Returns (record, True) once healthy. If the process dies, its engine reports a failure, or
    ``wait`` runs out (or the caller is interrupted), the whole process group is killed, the
    record removed, and ``RlcliError`` names the last error line of the log. Also raises if a
    server already runs here or the port is taken.
    """
    log = _prepare_start(home, launch.host, launch.port)
    with log.open("a") as out:
        out.write(f"\n==== rlcli serve start {time.strftime('%Y-%m-%d %H:%M:%S')}: ")
        out.write(" ".join(launch.command) + "\n")
        out.flush()
        offset = out.tell()
        process = subprocess.Popen(
            launch.command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives this CLI; stop signals its whole group
            env={**os.environ, **launch.env},
        )
    record = launch.record(process.pid, log)
    _write_record(home, record)
    deadline = time.monotonic() + wait
    failure = None
    try:
        while failure is None:
            exit_code = process.poll()
            if exit_code is not None:
                failure = f"the server exited while starting (exit code {exit_code}): "
                failure += str(last_error_line(log, offset))
                break
            healthy, detail = health(record.base_url, timeout=1.0)
            if healthy:
                remember_family(home, record)
                return record, True
            if not detail.startswith("no answer") and detail != LOADING:
                failure = f"the server failed while starting: {detail}"
                break
            if time.monotonic() >= deadline:
                failure = f"the server did not become healthy within --wait {wait:g}s: "
                failure += str(last_error_line(log, offset))
                break
            time.sleep(0.3)
    except BaseException:  # Ctrl-C while waiting: leave nothing behind
        pids.kill_group(process.pid, grace=2)
        _remove_record_of(home, process.pid)
        raise
    pids.kill_group(process.pid, grace=3)
    _remove_record_of(home, process.pid)
    one_line = " ".join(failure.split())
    if len(one_line) > 500:
        one_line = one_line[:497] + "..."
    raise RlcliError(f"{one_line} (log: {log})")


def run_foreground(home: Path, launch: Launch) -> int:
    """Run the server as this process's child until it exits; returns its exit code.

    Its output goes to this process's stdout (what a container runtime collects) and to the
    server log (what ``serve logs`` reads); this pid is recorded so ``serve status | stop``
    see the server. SIGTERM, SIGINT and SIGHUP are passed on to the server; if this process is
    killed outright, the server gets SIGTERM from the kernel (``die_with_parent``).
    """
    log = _prepare_start(home, launch.host, launch.port)
    me = os.getpid()

    def lifeline() -> None:
        pids.die_with_parent(signal.SIGTERM)
        if os.getppid() != me:  # the parent died before prctl took effect
            os._exit(1)

    with log.open("a") as out:
        out.write(f"\n==== rlcli serve start --foreground {time.strftime('%Y-%m-%d %H:%M:%S')}: ")
        out.write(" ".join(launch.command) + "\n")
        out.flush()
        child = subprocess.Popen(
            launch.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **launch.env},
            process_group=0,  # a terminal's Ctrl-C reaches this process only; it passes it on
            preexec_fn=lifeline,
        )

        def forward(signum, _frame) -> None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

        signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        previous = {s: signal.signal(s, forward) for s in signals}
        record = launch.record(me, log, foreground=True)
        _write_record(home, record)
        try:
            assert child.stdout is not None
            for raw in iter(child.stdout.readline, b""):
                with contextlib.suppress(OSError):
                    sys.stdout.buffer.write(raw)
                    sys.stdout.flush()
                out.write(raw.decode(errors="replace"))
                out.flush()
            return child.wait()
        finally:
            if child.poll() is None:
                pids.stop_child(child)
            _remove_record_of(home, me)
            for s, handler in previous.items():
                signal.signal(s, handler)


def stop(home: Path, grace: float = 15.0) -> tuple[ServerRecord | None, str]:
    """Stop the recorded server: SIGTERM, then SIGKILL after ``grace`` s.

    A detached server is signalled as a process group (uvicorn and its engine), then whatever
    of its session or process tree outlived it; a foreground one through its ``rlcli``
    process, which passes the signal on. A pid that is no longer the
    recorded process is never signalled: the record is stale.
    Returns (record or None, how it ended: "stopped" | "killed" | "not running" | "stale").
    """
    record, stale = live_record(home)
    if record is None:
        if stale is not None and not stale.foreground:
            # It died on its own: what it started may live on (an engine, Ray). Only the
            # members recorded with it, each still the same process in the same boot: a
            # session id equal to the old pid proves nothing once that pid has gone.
            pids.end_family(recorded_members(stale), grace=grace)
        return stale, "stale" if stale else "not running"

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if record.foreground:
                os.kill(record.pid, sig)
            else:
                os.killpg(record.pid, sig)

    members = {} if record.foreground else {**recorded_members(record), **pids.family(record.pid)}
    send(signal.SIGTERM)
    how = "stopped"
    deadline = time.monotonic() + grace
    while pids.pid_alive(record.pid):
        if time.monotonic() >= deadline:
            send(signal.SIGKILL)
            how = "killed"
            time.sleep(0.2)
            break
        time.sleep(0.1)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(record.pid, os.WNOHANG)
    if not record.foreground:  # what outlived the leader: SkyRL's engine, Ray's workers
        left = max(1.0, deadline - time.monotonic())
        pids.end_family({**members, **pids.family(record.pid)}, grace=left)
    _remove_record_of(home, record.pid)
    return record, how

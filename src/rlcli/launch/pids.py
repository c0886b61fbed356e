"""Processes by identity: a pid with its start time (the pair names one process, in one boot),
process trees and sessions, and ending them. Linux ``/proc`` only; nothing here knows about
servers or runs (``process.py`` records servers, ``runs/runner.py`` supervises recipes).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (``/proc/<pid>/stat`` field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (the command name) is in parentheses and may hold spaces: split after it.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])  # fields[0] is field 3 (state), so field 22 is fields[19]


def boot_id() -> str | None:
    """This boot's id (a new one after every reboot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


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


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (PR_SET_PDEATHSIG).

    Called in a child (a ``preexec_fn`` or the child's first lines); a parent that died before
    the call is caught by the ``getppid`` check the callers make right after it.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def family(pid: int) -> dict[int, int | None]:
    """Every other process in ``pid``'s session (a detached server leads its own) or below it,
    with its start time: what a stop must end. A process whose parent died (an engine's Ray
    workers after the engine) stays in the session; one that left the session is still found
    through its parent while that lives."""
    table: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            table[int(entry.name)] = (int(fields[1]), int(fields[3]))  # ppid, session
    found = {p for p, (_, session) in table.items() if session == pid}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for p, (ppid, _) in table.items():
            if ppid == parent and p not in found:
                found.add(p)
                frontier.append(p)
    found.discard(pid)
    return {p: start_ticks(p) for p in found}


def end_family(members: dict[int, int | None], grace: float) -> None:
    """SIGTERM what is left of ``members`` (each still the process recorded), SIGKILL after
    ``grace`` s."""

    def alive() -> list[int]:
        return [p for p, ticks in members.items() if pid_alive(p) and start_ticks(p) == ticks]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2)
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)


def kill_group(pid: int, grace: float) -> None:
    """SIGTERM the process group led by ``pid``, SIGKILL after ``grace`` s; reap if a child.
    Then the rest of its family (``family``)."""
    members = family(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the engine and anything else left in the group
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    end_family({**members, **family(pid)}, grace=1)


def stop_child(child: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the child's process group (the child and anything it started there), SIGKILL
    the group after ``grace`` s (also whatever the child left in it once it exited)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=5)

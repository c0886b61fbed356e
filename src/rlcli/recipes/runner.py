"""Running a cookbook recipe as a child process: progress, stopping, and the run folder lock.

The recipe (``python -m rlcli.recipes.child <run_dir>``) writes the cookbook's usual files into
the run folder; its console output goes to ``console.log`` there. This side:

- follows ``metrics.jsonl`` and ``rlcli_status.jsonl`` for progress (``progress.py``);
- watches the server's health next to the recipe: the SDK retries a vanished server without
  end, so after ``HEALTH_FAILURES`` failed checks in a row the recipe is stopped and the
  error names the URL and the resume command;
- stops the recipe on Ctrl-C, SIGTERM, SIGHUP and a closed output pipe (exit 130 / 143 / 129 /
  141); the child runs in its own session and dies with this process even on SIGKILL
  (``PR_SET_PDEATHSIG`` in ``child.py``), so no recipe ever runs on as an orphan;
- holds an ``flock`` on ``<run_dir>/rlcli.lock`` (shared with the child), so a second command on
  the same run folder fails at once, naming the pid; the kernel drops it when both are gone;
- turns a crash into one line (the child's ``rlcli-error:`` line, else the log's last lines).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from rlcli.errors import RlcliError
from rlcli.recipes.progress import STATUS, Progress, Rates, StepLine, read_events

__all__ = ["StepLine", "run_recipe", "lock_run_dir", "write_spec"]

SPEC = "rlcli_spec.json"
SUMMARY = "rlcli_summary.json"
CONSOLE = "console.log"
LOCK = "rlcli.lock"
HEALTH_EVERY_S = float(os.environ.get("RLCLI_HEALTH_EVERY_S") or 5.0)
HEALTH_FAILURES = 3  # in a row: refused connections are noticed in ~15 s, timeouts in ~40 s
PARENT_PID_ENV = "RLCLI_PARENT_PID"  # the child checks its parent is still this pid


def default_run_dir(kind: str) -> Path:
    from rlcli.home import rlcli_home

    return rlcli_home() / "runs" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def metric_values(run_dir: Path, *keys: str) -> dict[str, list[float]]:
    """Each key's numeric values, step by step, from the run's ``metrics.jsonl`` (read once)."""
    try:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    except FileNotFoundError:
        rows = []
    return {
        key: [float(r[key]) for r in rows if isinstance(r.get(key), int | float)] for key in keys
    }


def write_spec(run_dir: Path, spec: dict) -> None:
    """Take the run folder's lock (see ``lock_run_dir``), then write the recipe's spec."""
    lock_run_dir(run_dir)
    (run_dir / SPEC).write_text(json.dumps(spec, indent=2) + "\n")


_LOCKS: dict[Path, int] = {}  # run folder -> the locked file descriptor, for this process


def lock_run_dir(run_dir: Path) -> int:
    """Lock ``run_dir`` for this process (and the recipe child it starts); returns the fd.

    A second ``rlcli`` on the same folder gets one ``RlcliError`` naming the pid that holds it.
    Call it before anything is written into the folder; calling it again is free.
    """
    run_dir = Path(run_dir).resolve()
    if run_dir in _LOCKS:
        return _LOCKS[run_dir]
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RlcliError(
            f"run folder {run_dir} is in use by another rlcli command (pid {holder}); "
            f"wait for it to finish or stop it (kill {holder}) before resuming"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _LOCKS[run_dir] = fd
    return fd


def release_run_dir(run_dir: Path) -> None:
    fd = _LOCKS.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)  # the lock goes with the last descriptor (the child's died with it)


class _Stop(Exception):
    """A signal asked this process to stop the run."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


class _HealthWatch(threading.Thread):
    """Polls ``/api/v1/healthz``; ``failure`` says what happened after N failures in a row."""

    def __init__(self, base_url: str) -> None:
        super().__init__(name="rlcli-health-watch", daemon=True)
        self.url = f"{base_url.rstrip('/')}/api/v1/healthz"
        self.base_url = base_url
        self.failure: str | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        failures, checks, first = 0.0, 0, None
        while not self.stopped.wait(HEALTH_EVERY_S):
            detail = self.check()
            if detail is None:
                failures, checks, first = 0.0, 0, None
                continue
            # Nothing listening is certain; a slow answer may be a starved but live server,
            # so a timeout counts 3/4 (four in a row: about 40 s).
            failures += 0.75 if "Timeout" in detail else 1.0
            checks += 1
            first = first or time.monotonic()
            if failures >= HEALTH_FAILURES:
                took = time.monotonic() - first + HEALTH_EVERY_S
                self.failure = f"{detail}; {checks} health checks failed over {took:.0f}s"
                return

    def check(self) -> str | None:
        """None while the server is fine (or still loading its model); else what is wrong."""
        from rlcli import endpoint

        try:
            response = httpx.get(self.url, headers=endpoint.headers(), timeout=4.0)
        except httpx.HTTPError as e:
            return f"stopped answering ({type(e).__name__})"
        if response.status_code == 404 and self.url.endswith("/healthz"):
            # A server without our health route (SkyRL): any authenticated answer will do.
            self.url = self.url.removesuffix("/healthz") + "/get_server_capabilities"
            return self.check()
        if response.status_code == 200:
            return None
        try:
            detail = str(response.json().get("detail") or response.status_code)
        except (ValueError, AttributeError):
            detail = f"HTTP {response.status_code}"
        if detail == endpoint.LOADING:
            return None
        return f"is unhealthy ({detail[:200]})"


SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129, signal.SIGPIPE: 141}
SIGNAL_WHAT = {
    signal.SIGINT: "interrupted (Ctrl-C)",
    signal.SIGTERM: "stopped by SIGTERM",
    signal.SIGHUP: "stopped by SIGHUP (terminal closed)",
    signal.SIGPIPE: "the output pipe was closed",
}


def run_recipe(
    run_dir: Path,
    total_steps: int,
    show: dict[str, str],
    resume_hint: str,
    report: Callable[[str], None],
    tokens_key: str = "num_tokens",
    base_url: str | None = None,
) -> dict:
    """Run the recipe in ``run_dir``; returns its summary. ``show`` maps metric keys to the
    labels printed per step (e.g. ``{"train_mean_nll": "loss"}``); ``tokens_key`` is the
    per-step token count behind tokens/s; ``base_url`` (default: the spec's) is the server whose
    health is watched. Every way out stops the child first."""
    run_dir = Path(run_dir)
    lock_fd = lock_run_dir(run_dir)
    if base_url is None:
        with contextlib.suppress(FileNotFoundError, KeyError, TypeError, json.JSONDecodeError):
            base_url = json.loads((run_dir / SPEC).read_text())["options"]["base_url"]
    metrics = run_dir / "metrics.jsonl"
    seen = _count_lines(metrics)  # a resumed run already has rows
    events_seen = 0
    (run_dir / SUMMARY).unlink(missing_ok=True)
    (run_dir / STATUS).unlink(missing_ok=True)
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
    env.setdefault("TINKER_API_KEY", "tml-dummy")
    env.setdefault("TINKER_TELEMETRY", "0")
    watch = _HealthWatch(base_url) if base_url else None
    previous = {}

    def on_signal(signum, _frame):
        raise _Stop(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, on_signal)
    progress = Progress(total_steps, report)
    rates = Rates()
    stop_reason: tuple[str, int] | None = None  # (what happened, exit code)
    child = None
    try:
        with (run_dir / CONSOLE).open("a") as console:
            child = subprocess.Popen(
                [sys.executable, "-m", "rlcli.recipes.child", str(run_dir)],
                stdout=console,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches us; we stop it
                pass_fds=(lock_fd,),  # the child holds the run folder's lock too
            )
        if watch is not None:
            watch.start()
        while True:
            rows, seen = _new_rows(metrics, seen)
            now = time.monotonic()
            for row in rows:
                step = int(row.get("step", 0)) + 1
                rates.add(step, int(row.get(tokens_key) or 0))
            for i, row in enumerate(rows):
                step = int(row.get("step", 0)) + 1
                last = i == len(rows) - 1
                tokens_per_s, eta = rates.current(now, total_steps) if last else (None, None)
                values = {
                    label: float(row[key])
                    for key, label in show.items()
                    if isinstance(row.get(key), int | float)
                }
                progress.update(StepLine(step, total_steps, values, tokens_per_s, eta))
            if rows:
                rates.end_poll(now)
            events, events_seen = read_events(run_dir, events_seen)
            progress.phases(events)
            if child.poll() is not None:
                rows, seen = _new_rows(metrics, seen)
                if not rows:
                    break
                continue
            if watch is not None and watch.failure:
                stop_reason = (f"the server at {base_url} {watch.failure}", 1)
                break
            time.sleep(0.25)
    except KeyboardInterrupt:
        stop_reason = (SIGNAL_WHAT[signal.SIGINT], SIGNAL_EXIT[signal.SIGINT])
    except _Stop as e:
        stop_reason = (SIGNAL_WHAT[e.signum], SIGNAL_EXIT[e.signum])
    except BrokenPipeError:
        stop_reason = (SIGNAL_WHAT[signal.SIGPIPE], SIGNAL_EXIT[signal.SIGPIPE])
    finally:
        _ignore_stop_signals()  # stopping is under way: a second Ctrl-C must not cut it short
        if watch is not None:
            watch.stopped.set()
        if child is not None and child.poll() is None:
            _stop_child(child)
        with contextlib.suppress(BrokenPipeError, OSError):
            progress.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        release_run_dir(run_dir)
    if stop_reason is not None:
        what, code = stop_reason
        raise RlcliError(f"{what}; stopped the run. Resume with: {resume_hint}", exit_code=code)
    if child.returncode != 0:
        gone = watch.check() if watch is not None else None  # did the recipe fail for that?
        if gone:
            raise RlcliError(
                f"the server at {base_url} {gone}; the run failed. Resume with: {resume_hint}"
            )
        raise RlcliError(_failure(run_dir, child.returncode))
    try:
        return json.loads((run_dir / SUMMARY).read_text())
    except FileNotFoundError:
        raise RlcliError(_failure(run_dir, child.returncode)) from None


def _stop_child(child: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the child's session (the recipe and anything it started), SIGKILL after
    ``grace`` s."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)  # also whatever the recipe left in its session
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=5)


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(sig, signal.SIG_IGN)


def _failure(run_dir: Path, code: int) -> str:
    lines = (run_dir / CONSOLE).read_text(errors="replace").splitlines()
    reason = next((ln for ln in reversed(lines) if ln.startswith("rlcli-error: ")), None)
    if reason:
        return reason.removeprefix("rlcli-error: ")
    tail = "\n  ".join(lines[-12:])
    log = run_dir / CONSOLE
    return f"the training run failed (exit code {code}); last lines of {log}:\n  {tail}"


def _count_lines(path: Path) -> int:
    try:
        return sum(1 for _ in path.open())
    except FileNotFoundError:
        return 0


def _new_rows(path: Path, seen: int) -> tuple[list[dict], int]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return [], seen
    rows = []
    for line in lines[seen:]:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a row still being written: read it next time
            break
    return rows, seen + len(rows)

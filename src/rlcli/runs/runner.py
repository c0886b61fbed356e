"""Running a cookbook recipe as a child process: progress, stopping, and the run folder lock.

The recipe (``python -m rlcli.runs.child <run_dir>``) writes the cookbook's usual files into
the run folder; its console output goes to ``console.log`` there. This side:

- follows ``metrics.jsonl`` and ``rlcli_status.jsonl`` for progress (``progress.py``);
- watches the server's health next to the recipe: the SDK retries a vanished server without
  end, so after ``HEALTH_FAILURES`` failed checks in a row the recipe is stopped and the
  error names the URL and the resume command;
- stops the recipe on Ctrl-C, SIGTERM, SIGHUP and a closed output pipe (exit 130 / 143 / 129 /
  141); Ctrl-C first asks it for a checkpoint at its step boundary, as ``runs cancel`` does,
  and waits ``CTRL_C_SAVE_S`` for it;
- says "Resume with" only when a checkpoint exists, and before a run drops the
  ``metrics.jsonl`` rows of steps its last checkpoint does not hold (they are trained again);
- the child runs in its own session and dies with this process even on SIGKILL
  (``PR_SET_PDEATHSIG`` in ``child.py``), so no recipe ever runs on as an orphan;
- holds an ``flock`` on ``<run_dir>/rlcli.lock`` (shared with the child), so a second command on
  the same run folder fails at once, naming the pid; the kernel drops it when both are gone;
- turns a crash into one line (the child's ``rlcli-error:`` line, else the log's last lines);
- keeps the run's record, ``rlcli_run.json`` (written whole, then renamed): running with this
  pid, then finished / failed (the one-line error) / interrupted (the signal) / cancelled, with
  the exit code; ``rlcli runs`` reads it (a record still saying running while the lock is free
  is a run killed hard). Folders outside ``$RLCLI_HOME/runs`` are listed in its ``index.txt``;
- ``rlcli runs cancel`` writes ``rlcli_cancel`` (this process's pid) into the folder; the child
  checks it at each step boundary (``run_hooks.install_cancel_hook``), saves a checkpoint and exits
  with ``CANCELLED_EXIT``; the run is recorded as cancelled. ``--max-minutes`` writes the same
  request when its time is up, and the run is recorded as stopped (exit 0);
- times the run (``timing.StepClock``: start-up, steps, final save) into its record, which
  ``train --dry-run``'s estimate reads.
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

from rlcli.client import endpoint
from rlcli.errors import Cancelled, RlcliError, RunFailed
from rlcli.files.lastline import last_error_line
from rlcli.home import rlcli_home
from rlcli.launch.pids import start_ticks, stop_child
from rlcli.runs import folder
from rlcli.runs.folder import CANCEL, CONSOLE, LOCK, SPEC, STATUS, SUMMARY
from rlcli.runs.progress import Follower, Reporter, StepLine
from rlcli.runs.timing import StepClock

__all__ = ["StepLine", "run_recipe", "lock_run_dir", "write_spec"]

CANCELLED_EXIT = 4  # the recipe stopped at a `runs cancel` request, after a checkpoint
INHERITED_LOCK_ENV = "RLCLI_RUN_LOCK_FD"  # a detached run's lock, handed over (train --detach)
# Environment knobs for tests (a frozen server is then noticed in seconds, not ~40 s).
HEALTH_EVERY_S = float(os.environ.get("RLCLI_HEALTH_EVERY_S") or 5.0)
HEALTH_TIMEOUT_S = float(os.environ.get("RLCLI_HEALTH_TIMEOUT_S") or 4.0)  # per check
HEALTH_FAILURES = 3  # in a row: refused connections are noticed in ~15 s, timeouts in ~40 s
PARENT_PID_ENV = "RLCLI_PARENT_PID"  # the child checks its parent is still this pid


def default_run_dir(kind: str) -> Path:
    return rlcli_home() / "runs" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def metric_values(run_dir: Path, *keys: str) -> dict[str, list[float]]:
    """Each key's numeric values, step by step, from the run's ``metrics.jsonl`` (read once)."""
    rows = folder.metric_rows(run_dir)  # a torn line is skipped
    return {
        key: [float(r[key]) for r in rows if isinstance(r.get(key), int | float)] for key in keys
    }


def write_spec(run_dir: Path, spec: dict) -> None:
    """Take the run folder's lock (see ``lock_run_dir``), then write the recipe's spec."""
    lock_run_dir(run_dir)
    folder.write_spec(run_dir, spec)


_LOCKS: dict[Path, int] = {}  # run folder -> the locked file descriptor, for this process


def lock_run_dir(run_dir: Path) -> int:
    """Lock ``run_dir`` for this process (and the recipe child it starts); returns the fd.

    A second ``rlcli`` on the same folder gets one ``RlcliError`` naming the pid that holds it.
    Call it before anything is written into the folder; calling it again is free.
    """
    run_dir = Path(run_dir).resolve()
    if run_dir in _LOCKS:
        return _LOCKS[run_dir]
    inherited = os.environ.get(INHERITED_LOCK_ENV, "")
    fd_text, _, path = inherited.partition(":")
    if fd_text.isdigit() and Path(path) == run_dir:
        # A detached run (``train --detach``): the foreground command took the lock and handed
        # its descriptor over, so the folder was never unlocked in between.
        del os.environ[INHERITED_LOCK_ENV]
        fd = int(fd_text)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _LOCKS[run_dir] = fd
        return fd
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
        try:
            response = httpx.get(self.url, headers=endpoint.headers(), timeout=HEALTH_TIMEOUT_S)
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
    report: Callable[[str], None] | Reporter,
    tokens_key: str = "num_tokens",
    base_url: str | None = None,
    max_minutes: float | None = None,
    limit_after_first_step: bool = False,
) -> dict:
    """Run the recipe in ``run_dir``; returns its summary. ``report`` gets the progress (a
    ``Reporter``; a function printing a line gets the CLI's display); ``show`` maps metric
    keys to the step lines' labels (e.g. ``{"train_mean_nll": "loss"}``); ``tokens_key`` is the
    per-step token count behind tokens/s; ``base_url`` (default: the spec's) is the server whose
    health is watched; after ``max_minutes`` the recipe is asked to stop at its next step
    boundary with a checkpoint, as ``runs cancel`` does, and the run ends as "stopped" (exit 0,
    the summary says where and how to resume; ``limit_after_first_step``: minutes counted from
    the first step, as the dry run's calibration does). Every way out stops the child first,
    and leaves the outcome and the run's timing (``timing.StepClock``) in its record
    (``rlcli_run.json``)."""
    run_dir = Path(run_dir)
    lock_fd = lock_run_dir(run_dir)
    spec = folder.read_json(run_dir / SPEC)
    if base_url is None:
        with contextlib.suppress(KeyError, TypeError, AttributeError):
            base_url = spec["options"]["base_url"]
    record = start_record(run_dir, spec, total_steps, base_url)
    drop_unsaved_steps(run_dir)
    (run_dir / SUMMARY).unlink(missing_ok=True)
    (run_dir / STATUS).unlink(missing_ok=True)
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
    env.pop(INHERITED_LOCK_ENV, None)
    env.setdefault("TINKER_API_KEY", "tml-dummy")
    env.setdefault("TINKER_TELEMETRY", "0")
    watch = _HealthWatch(base_url) if base_url else None
    previous = {}

    def on_signal(signum, _frame):
        raise _Stop(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, on_signal)
    stop_reason: tuple[str, int] | None = None  # (what happened, exit code)
    child = None
    follower = None
    clock = StepClock()
    limit = TimeLimit(max_minutes, clock, limit_after_first_step)
    try:
        follower = Follower(run_dir, total_steps, show, report, tokens_key)
        with (run_dir / CONSOLE).open("a") as console:
            child = subprocess.Popen(
                [sys.executable, "-m", "rlcli.runs.child", str(run_dir)],
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
            new_steps = follower.poll()
            clock.steps_arrived(new_steps)
            if child.poll() is not None:
                if not new_steps:
                    break
                continue
            if limit.reached(run_dir):
                follower.progress.message(limit.message())
            if watch is not None and watch.failure:
                stop_reason = (f"the server at {base_url} {watch.failure}", 1)
                break
            time.sleep(0.25)
    except KeyboardInterrupt:
        stop_reason = (SIGNAL_WHAT[signal.SIGINT], SIGNAL_EXIT[signal.SIGINT])
        _save_before_stopping(run_dir, child, follower)
    except _Stop as e:
        stop_reason = (SIGNAL_WHAT[e.signum], SIGNAL_EXIT[e.signum])
    except BrokenPipeError:
        stop_reason = (SIGNAL_WHAT[signal.SIGPIPE], SIGNAL_EXIT[signal.SIGPIPE])
    except BaseException as e:  # a bug here: record it, stop the child, let it propagate
        end_record(run_dir, record, "failed", 1, f"{type(e).__name__}: {e}")
        raise
    finally:
        clock.end()
        _ignore_stop_signals()  # stopping is under way: a second Ctrl-C must not cut it short
        if watch is not None:
            watch.stopped.set()
        if child is not None and child.poll() is None:
            stop_child(child)
        with contextlib.suppress(BrokenPipeError, OSError, AttributeError):
            follower.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    record["timing"] = clock.summary()
    try:
        if limit.hit and stop_reason is None and child.returncode == CANCELLED_EXIT:
            return _stopped_at_limit(run_dir, record, limit, total_steps, resume_hint)
        return _outcome(run_dir, record, child, stop_reason, watch, base_url, resume_hint)
    finally:
        (run_dir / CANCEL).unlink(missing_ok=True)
        release_run_dir(run_dir)


class TimeLimit:
    """``--max-minutes``: past it, ask the recipe once to stop at its next step boundary."""

    def __init__(self, minutes: float | None, clock: StepClock, after_first_step: bool) -> None:
        self.minutes, self.clock, self.after_first_step = minutes, clock, after_first_step
        self.hit = False

    def reached(self, run_dir: Path) -> bool:
        """True the first time the limit has passed (and the stop was requested then)."""
        start = self.clock.first if self.after_first_step else self.clock.start
        if self.hit or self.minutes is None or start is None:
            return False
        if time.monotonic() < start + self.minutes * 60:
            return False
        self.hit = True
        folder.request_cancel(run_dir, os.getpid())
        return True

    def message(self) -> str:
        return (
            f"--max-minutes {self.minutes:g} reached: stopping at the end of this step, "
            "with a checkpoint"
        )


def _stopped_at_limit(run_dir, record, limit: TimeLimit, total_steps: int, resume_hint) -> dict:
    """The run stopped at ``--max-minutes`` with a checkpoint: recorded as "stopped" and
    summarised (exit 0: the user asked for the bound)."""
    done = _steps_done(run_dir)
    what = f"stopped at --max-minutes {limit.minutes:g} after step {done} of {total_steps}"
    end_record(run_dir, record, "stopped", 0, what)
    last = last_checkpoint(run_dir) or {}
    return {
        "run_dir": str(run_dir),
        "stopped": what,
        "steps_done": done,
        "total_steps": total_steps,
        "state_path": last.get("state_path"),
        "sampler_path": last.get("sampler_path"),
        "resume": resume_hint,
    }


def _outcome(run_dir, record, child, stop_reason, watch, base_url, resume_hint) -> dict:
    """The summary of a finished run, else the ``RlcliError`` saying how it ended; either way
    the run's record says it first."""
    resume = _resume_line(run_dir, resume_hint)
    saved = child is not None and child.returncode == CANCELLED_EXIT
    if stop_reason is not None:
        what, code = stop_reason
        status = "failed" if code == 1 else "interrupted"
        if saved:  # Ctrl-C, and the recipe saved a checkpoint at its step boundary
            what = f"{what} after step {_steps_done(run_dir)}; {_final_checkpoint(run_dir)}"
        end_record(run_dir, record, status, code, what)
        raise RunFailed(f"{what}; stopped the run. {resume}", run_dir, what, exit_code=code)
    if saved:
        end_record(run_dir, record, "cancelled", CANCELLED_EXIT, None)
        raise Cancelled(
            f"cancelled (rlcli runs cancel) after step {_steps_done(run_dir)}; "
            f"{_final_checkpoint(run_dir)}. {resume}",
            exit_code=CANCELLED_EXIT,
        )
    if child.returncode != 0:
        gone = watch.check() if watch is not None else None  # did the recipe fail for that?
        if gone:
            what = f"the server at {base_url} {gone}"
            end_record(run_dir, record, "failed", 1, what)
            raise RunFailed(f"{what}; the run failed. {resume}", run_dir, what)
        failure = _failure(run_dir, child.returncode)
        end_record(run_dir, record, "failed", 1, failure.splitlines()[0])
        raise RunFailed(failure, run_dir, failure.splitlines()[0])
    try:
        summary = json.loads((run_dir / SUMMARY).read_text())
    except FileNotFoundError:
        failure = _failure(run_dir, child.returncode)
        end_record(run_dir, record, "failed", 1, failure.splitlines()[0])
        raise RunFailed(failure, run_dir, failure.splitlines()[0]) from None
    end_record(run_dir, record, "finished", 0, None)
    return summary


# ---- the run's record: what ``rlcli runs`` reads --------------------------------------------


def start_record(run_dir: Path, spec: dict, total_steps: int, base_url: str | None) -> dict:
    """Record the run as running by this process, and list its folder in the run index."""
    run_dir = Path(run_dir).resolve()
    options = spec.get("options") or {}
    before = folder.read_record(run_dir) or {}
    record = {
        "id": run_dir.name,
        "run_dir": str(run_dir),
        "kind": spec.get("recipe"),
        "model": options.get("model"),
        "status": "running",
        "pid": os.getpid(),
        "pid_start": start_ticks(os.getpid()),
        "started": time.time(),
        "ended": None,
        "exit_code": None,
        "error": None,
        "total_steps": total_steps,
        "base_url": base_url,
        "detached_log": before.get("detached_log") if before.get("pid") == os.getpid() else None,
    }
    folder.write_record(run_dir, record)
    register_run(run_dir)
    return record


def end_record(run_dir: Path, record: dict, status: str, code: int, error: str | None) -> None:
    with contextlib.suppress(OSError):
        folder.write_record(
            run_dir,
            {**record, "status": status, "ended": time.time(), "exit_code": code, "error": error},
        )


def register_run(run_dir: Path) -> None:
    """Add a run folder outside ``$RLCLI_HOME/runs`` to ``$RLCLI_HOME/runs/index.txt`` (one
    absolute path a line; gone folders dropped on the way), so ``rlcli runs`` finds it."""
    runs = rlcli_home() / "runs"
    run_dir = Path(run_dir).resolve()
    if run_dir.parent == runs.resolve():
        return
    with contextlib.suppress(OSError):
        folder.add_to_index(runs, run_dir)


def last_checkpoint(run_dir: Path) -> dict | None:
    """The run's last checkpoint a resume can start from (one with a state)."""
    rows = [r for r in folder.checkpoint_rows(run_dir) if r.get("state_path")]
    return rows[-1] if rows else None


def _final_checkpoint(run_dir: Path) -> str:
    last = last_checkpoint(run_dir) or {}
    where = ", ".join(f"{k} {last[k]}" for k in ("state_path", "sampler_path") if k in last)
    return f"final checkpoint: {where or 'none'}"


def _resume_line(run_dir: Path, resume_hint: str) -> str:
    """How to go on: resume from the last checkpoint, or, with none saved, start over."""
    if last_checkpoint(run_dir) is not None:
        return f"Resume with: {resume_hint}"
    return f"No checkpoint was saved yet: running it again starts over ({resume_hint})"


def drop_unsaved_steps(run_dir: Path) -> None:
    """Before the recipe starts: drop the ``metrics.jsonl`` rows of steps no checkpoint holds
    (an earlier attempt's steps past its last save), since the recipe trains them again and
    appends their rows anew. Checkpoints are named by the steps they hold (``compat``); with
    none, the run starts over and every row goes. A finished run keeps its rows."""
    path = Path(run_dir) / folder.METRICS_FILE
    if not path.exists():
        return
    last = last_checkpoint(run_dir) or {}
    name = str(last.get("name", "0"))
    if not name.isdigit():  # "final": the run is complete and nothing is trained again
        return
    held = int(name)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # sl: where it resumes
        per_epoch = json.loads((Path(run_dir) / SPEC).read_text())["plan"]["batches_per_epoch"]
        held = int(last["epoch"]) * int(per_epoch) + int(last["batch"])
    rows = folder.metric_rows(run_dir)
    kept = [r for r in rows if not isinstance(r.get("step"), int) or r["step"] < held]
    if len(kept) == len(rows) and path.read_bytes().endswith(b"\n"):
        return
    folder.write_metric_rows(run_dir, kept)  # also drops a row a killed run left half-written


CTRL_C_SAVE_S = float(os.environ.get("RLCLI_CTRL_C_SAVE_S") or 10.0)


def _save_before_stopping(run_dir: Path, child, follower) -> None:
    """Ctrl-C: ask the recipe to save a checkpoint at its next step boundary, as ``runs
    cancel`` does, and give it ``CTRL_C_SAVE_S`` seconds; a second Ctrl-C stops it at once."""
    if child is None or child.poll() is not None:
        return
    folder.request_cancel(run_dir, os.getpid())
    with contextlib.suppress(BrokenPipeError, OSError):
        follower.progress.message(
            f"Ctrl-C: saving a checkpoint at the end of this step (up to {CTRL_C_SAVE_S:g}s; "
            "Ctrl-C again stops now)"
        )
    deadline = time.monotonic() + CTRL_C_SAVE_S
    try:
        while child.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(BrokenPipeError, OSError):
                follower.poll()
            time.sleep(0.1)
    except (KeyboardInterrupt, _Stop):
        return


def _steps_done(run_dir: Path) -> int:
    rows = folder.metric_rows(run_dir)
    return max((int(r.get("step", -1)) + 1 for r in rows), default=0)


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(sig, signal.SIG_IGN)


def _failure(run_dir: Path, code: int) -> str:
    text = (run_dir / CONSOLE).read_text(errors="replace")
    reason = last_error_line(text, folder.ERROR_PREFIX, limit=100_000)
    if reason:
        return reason
    lines = text.splitlines()
    tail = "\n  ".join(lines[-12:])
    log = run_dir / CONSOLE
    return f"the training run failed (exit code {code}); last lines of {log}:\n  {tail}"

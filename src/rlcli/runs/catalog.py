"""Training runs as folders: find them, read their state, summarise, follow, cancel and plot.

A run folder says its own state. ``rlcli_run.json`` (written by ``runs/runner.py``) holds the
status (running / finished / failed / interrupted / cancelled), the ``rlcli`` pid, the start and
end, the exit code and the one-line error; the folder's ``rlcli.lock`` is held (``flock``) while a
command works on it. A record saying running whose lock is free is a run killed hard (kill -9,
a crash): it is reported as interrupted. Folders from before the record are read from what the
cookbook and rlcli left (``rlcli_spec.json``, ``metrics.jsonl``, ``rlcli_summary.json``, the
``rlcli-error:`` line in ``console.log``). Runs live in ``$RLCLI_HOME/runs``; those elsewhere
(``--log-path``) are found through ``$RLCLI_HOME/runs/index.txt``. A run's id is its folder name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from rlcli.errors import RlcliError
from rlcli.files import atomic, lastline
from rlcli.home import rlcli_home
from rlcli.launch.pids import pid_alive, start_ticks
from rlcli.runs import folder
from rlcli.runs.folder import (
    CONSOLE,
    DETACHED_LOG,
    LOCK,
    METRICS_FILE,
    RECORD,
    SPEC,
    SUMMARY,
    lock_held,
    metric_rows,
    read_json,
    read_record,
)

LIVE = ("starting", "running")
EXIT_OF = {"finished": 0, "stopped": 0, "failed": 1, "cancelled": 4, "interrupted": 130}

# What each kind of run is judged by: (metrics.jsonl key, label), the first is the headline.
METRICS = {
    "sl": (("train_mean_nll", "loss"), ("test/nll", "held-out loss")),
    "rl": (
        ("env/all/reward/total", "reward"),
        ("env/all/correct", "accuracy"),
        # rlcli's torch server: mean |logp_train - logp_sampler| per sampled token, per step
        ("rlcli/logp_diff_mean:mean", "sampler/trainer |dlogp|"),
    ),
    "dpo": (("dpo_loss", "loss"), ("margin", "margin"), ("accuracy", "accuracy")),
    # kl: the k3 estimate (never negative, compat/distill.py); the cookbook's own mean
    # log p - log q beside it (and in runs from before rlcli logged k3)
    "opsd": (("rlcli/teacher_kl_k3", "kl"), ("teacher_kl", "log p - log q")),
    "internalize": (("train_mean_nll", "loss"),),
    "harbor": (("env/all/reward/total", "reward"), ("env/all/test_passed", "passed")),
    # rlcli demo (demo/record.py); --loop: the served alias's held-out score after each round
    "demo": (("rl_reward", "RL reward"), ("sft_loss", "SFT loss"), ("held_out", "held-out score")),
}


def runs_root() -> Path:
    return rlcli_home() / "runs"


def _looks_like_run(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).exists() for name in (RECORD, SPEC, "config.yaml", LOCK)
    )


def discover() -> list[Path]:
    """Every run folder: those in ``$RLCLI_HOME/runs`` and those its index names (gone ones
    skipped)."""
    root = runs_root()
    found: dict[Path, None] = {}
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if _looks_like_run(entry):
                found[entry.resolve()] = None
    for path in folder.read_index(root):
        if _looks_like_run(path):
            found[path.resolve()] = None
    return list(found)


def resolve(run: str) -> Path:
    """A run id (its folder name, or a unique prefix of one) or a path to a run folder."""
    path = Path(run).expanduser()
    if ("/" in run or run in (".", "..")) and path.is_dir():
        if not _looks_like_run(path):
            raise RlcliError(f"{run}: not a run folder (no rlcli_run.json, config.yaml or spec)")
        return path.resolve()
    runs = discover()
    exact = [p for p in runs if p.name == run]
    matches = exact or [p for p in runs if p.name.startswith(run)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        if path.is_dir() and _looks_like_run(path):
            return path.resolve()
        raise RlcliError(
            f"no run {run!r} in {runs_root()} or its index (`rlcli runs list` shows them; "
            "a run folder's path works too)"
        )
    shown = ", ".join(str(p) for p in matches[:4])
    raise RlcliError(f"run {run!r} is ambiguous: {shown}; give the folder's path")


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _last_line(path: Path, prefix: str = "") -> str | None:
    """The last line of ``path`` starting with ``prefix`` (prefix removed), else the last
    error-looking or non-empty line."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    if prefix:
        return lastline.last_error_line(text, prefix, limit=100_000)
    return lastline.last_error_line(text, limit=500) or lastline.last_line(text, 500)


def last_measured(rows: list[dict], kind: str | None) -> dict:
    """The last value of each metric the kind is judged by, with its step: a metric measured
    only some steps (the held-out loss of ``--eval-every``) is often not in the last row."""
    out = {}
    for key, label in METRICS.get(kind or "", ()):
        for row in reversed(rows):
            if isinstance(row.get(key), int | float):
                out[label] = {"step": row.get("step"), "value": row[key]}
                break
    return out


def state(run_dir: Path) -> dict:
    """One run's summary: what ``runs list`` shows a line of."""
    run_dir = Path(run_dir)
    record = read_record(run_dir) or {}
    spec = read_json(run_dir / SPEC)
    options, plan = spec.get("options") or {}, spec.get("plan") or {}
    rows = metric_rows(run_dir)
    held = lock_held(run_dir)
    kind = record.get("kind") or spec.get("recipe")
    status, error = _status(run_dir, record, held)
    started = record.get("started") or _mtime(run_dir / SPEC) or _mtime(run_dir / "config.yaml")
    ended = None
    if status not in LIVE:
        ended = record.get("ended") if record.get("status") not in LIVE else None
        ended = ended or _mtime(run_dir / METRICS_FILE) or _mtime(run_dir / CONSOLE)
    last_label, last_value = None, None
    for key, label in METRICS.get(kind or "", ()):  # the headline, else the first measured
        values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        if values:
            last_label, last_value = label, float(values[-1])
            break
    total = record.get("total_steps") or plan.get("steps")
    return {
        "id": run_dir.name,
        "run_dir": str(run_dir),
        "kind": kind,
        "model": record.get("model") or options.get("model"),
        "status": status,
        "steps_done": max((int(r.get("step", -1)) + 1 for r in rows), default=0),
        "total_steps": total,
        "last_metric": last_label,
        "last_value": last_value,
        "started": started,
        "ended": ended,
        "duration_s": (ended or time.time()) - started if started else None,
        "pid": record.get("pid") or (folder.lock_pid(run_dir) if held else None),
        "exit_code": record.get("exit_code") if status == record.get("status") else None,
        "error": error,
    }


def _status(run_dir: Path, record: dict, held: bool) -> tuple[str, str | None]:
    recorded = record.get("status")
    if recorded in LIVE:
        if held:
            return recorded, None
        if recorded == "starting":  # a detached run that never got to train
            log = record.get("detached_log") or str(run_dir / DETACHED_LOG)
            why = _last_line(Path(log))
            return "failed", f"exited before training started ({why or 'no output'}; {log})"
        return "interrupted", (
            f"the rlcli process (pid {record.get('pid')}) ended without recording how "
            "(killed with SIGKILL, or the machine stopped)"
        )
    if recorded:
        return recorded, record.get("error")
    # A folder from before rlcli_run.json.
    if held:
        return "running", None
    if (run_dir / SUMMARY).exists():
        return "finished", None
    error = _last_line(run_dir / CONSOLE, folder.ERROR_PREFIX)
    if error:
        return "failed", error
    return "interrupted", None


def list_runs() -> list[dict]:
    """Every run's state, newest first."""
    states = [state(p) for p in discover()]
    return sorted(states, key=lambda s: s["started"] or 0, reverse=True)


def show(run_dir: Path) -> dict:
    """A run in full: its state, resolved config, last metrics row, checkpoints and logs."""
    import yaml

    run_dir = Path(run_dir)
    out = state(run_dir)
    config = None
    with contextlib.suppress(OSError, yaml.YAMLError):
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = metric_rows(run_dir)
    record = read_record(run_dir) or {}
    logs = {"console": str(run_dir / CONSOLE)}
    if record.get("detached_log") or (run_dir / DETACHED_LOG).exists():
        logs["detached"] = record.get("detached_log") or str(run_dir / DETACHED_LOG)
    return {
        **out,
        "config": config,
        "last_metrics": rows[-1] if rows else None,
        "last_measured": last_measured(rows, out["kind"]),
        "checkpoints": folder.checkpoint_rows(run_dir),
        "summary": read_json(run_dir / SUMMARY) or None,
        "logs": logs,
    }


# ---- export: which checkpoint -----------------------------------------------------------


def checkpoint_path(run: str, with_optimizer: bool) -> str:
    """The last checkpoint a run folder recorded (``checkpoints.jsonl``): its sampler path, or
    its state path with ``with_optimizer``. ``run`` is any id ``rlcli runs`` takes (a run's
    name, a unique prefix of one, a run folder's path, a ``--log-path`` folder in the index)."""
    run_dir = Path(run).expanduser()  # any folder with a checkpoints.jsonl (the cookbook's too)
    if not run_dir.is_dir() or "/" not in run:
        try:
            run_dir = resolve(run)
        except RlcliError:
            run_dir = runs_root() / run  # a folder there that rlcli did not start
            if not run_dir.is_dir():
                raise
    rows = folder.checkpoint_rows(run_dir)  # the cookbook's, wherever it ran
    key = "state_path" if with_optimizer else "sampler_path"
    paths = [r[key] for r in rows if r.get(key)]
    if not paths:
        what = "training state" if with_optimizer else "sampler checkpoint"
        raise RlcliError(f"{run_dir}: the run recorded no {what} in checkpoints.jsonl")
    return paths[-1]


# ---- cancel ---------------------------------------------------------------------------------


def cancel(run_dir: Path, wait: float = 120.0, force: bool = False, report=None) -> dict:
    """Ask a running run to stop at its next step boundary with a checkpoint (``--force``:
    SIGTERM its ``rlcli`` process, no checkpoint), then wait until it has stopped."""

    run_dir = Path(run_dir)
    now = state(run_dir)
    if now["status"] not in LIVE:
        raise RlcliError(f"run {now['id']} is not running ({now['status']}); nothing to cancel")
    record = read_record(run_dir) or {}
    pid = record.get("pid") if record.get("status") in LIVE else None
    pid = pid or folder.lock_pid(run_dir)
    if pid is None or not pid_alive(pid):
        raise RlcliError(f"run {now['id']}: cannot tell which process runs it (see {run_dir})")
    if record.get("pid") == pid and record.get("pid_start") not in (None, start_ticks(pid)):
        raise RlcliError(f"run {now['id']}: pid {pid} is no longer the process that ran it")
    if force:
        os.kill(pid, signal.SIGTERM)
    else:
        folder.request_cancel(run_dir, pid)
    if report:
        what = "sent SIGTERM" if force else "asked it to stop after its current step"
        report(f"cancelling {now['id']}: {what}; waiting up to {wait:g}s")
    stands = "" if force else "; the request stands: it stops after its current step"
    deadline = time.monotonic() + wait
    try:
        while lock_held(run_dir) and time.monotonic() < deadline:
            time.sleep(0.25)
    except KeyboardInterrupt:
        raise RlcliError(f"stopped waiting for run {now['id']}{stands}", exit_code=130) from None
    if lock_held(run_dir):
        hint = "" if force else "; to stop it now without a checkpoint: --force"
        raise RlcliError(
            f"run {now['id']} has not stopped after {wait:g}s{stands} (rlcli runs show "
            f"{now['id']} -f follows it){hint}"
        )
    record = read_record(run_dir) or {}
    if force and record.get("status") == "starting" and record.get("pid") == pid:
        # Stopped during its checks, before the runner could record anything.
        folder.write_record(
            run_dir,
            {**record, "status": "interrupted", "ended": time.time(), "exit_code": 143,
             "error": "stopped by rlcli runs cancel --force before training started"},
        )  # fmt: skip
    after = state(run_dir)
    checkpoints = folder.checkpoint_rows(run_dir)
    last = checkpoints[-1] if checkpoints else None
    if not force and after["status"] != "cancelled":
        if after["status"] == "finished":
            raise RlcliError(
                f"run {after['id']} finished instead (the request came during its last step, "
                "which ends with the final checkpoint anyway): rlcli runs show "
                f"{after['id']}"
            )
        raise RlcliError(
            f"run {after['id']} ended {after['status']} before it could be cancelled"
            + (f": {after['error']}" if after["error"] else "")
        )
    return {
        "id": after["id"],
        "run_dir": after["run_dir"],
        "status": after["status"],
        "steps_done": after["steps_done"],
        "total_steps": after["total_steps"],
        # the cancel's own checkpoint, or the one saved at that very step (not saved twice)
        "checkpoint": last if (last and not force) else None,
    }


# ---- plot -----------------------------------------------------------------------------------


def series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Each headline metric of the run's kind, as (step, value) points from metrics.jsonl."""
    kind = state(run_dir)["kind"]
    rows = metric_rows(run_dir)
    out = {}
    for key, _label in METRICS.get(kind or "", ()):
        points = [
            (int(r.get("step", i)) + 1, float(r[key]))
            for i, r in enumerate(rows)
            if isinstance(r.get(key), int | float)
        ]
        if points:
            out[key] = points
    return out


def plot(run_dirs: list[Path], out: Path | None = None) -> dict:
    """One PNG, one panel per metric any run has, the runs overlaid (legend: run ids)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    labels = {key: label for pairs in METRICS.values() for key, label in pairs}
    order = list(dict.fromkeys(key for pairs in METRICS.values() for key, _ in pairs))
    by_run = [(Path(d), series(Path(d))) for d in run_dirs]
    panels = [key for key in order if any(key in s for _, s in by_run)]
    if not panels:
        names = ", ".join(d.name for d, _ in by_run)
        raise RlcliError(f"nothing to plot: no loss, reward or KL steps in {names} yet")
    out = Path(out) if out else Path(run_dirs[0]) / "curves.png"
    if out.suffix.lower() != ".png":
        raise RlcliError(f"-o {out}: the plot is a PNG; name the file *.png")
    if not out.parent.is_dir():
        raise RlcliError(f"-o {out}: no folder {out.parent}")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    report = []
    for ax, key in zip(axes[0], panels, strict=True):
        drawn = []
        for run_dir, run_series in by_run:
            points = run_series.get(key)
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], label=run_dir.name)
            drawn.append({"run": run_dir.name, "points": len(points)})
        ax.set_title(labels[key])
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        report.append({"metric": key, "label": labels[key], "series": drawn})
    fig.tight_layout()
    try:
        with atomic.replacing(out) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)
    return {"path": str(out), "panels": report}


# ---- display --------------------------------------------------------------------------------


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else ""


def duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def model_name(model: str | None) -> str:
    """A local model folder by its last part; hub ids as they are."""
    if not model:
        return ""
    return Path(model).name if model.startswith(("/", ".", "~")) else model


def row(s: dict) -> dict:
    """A state as a line of the ``runs list`` table."""
    steps = f"{s['steps_done']}/{s['total_steps']}" if s["total_steps"] else str(s["steps_done"])
    last = f"{s['last_metric']} {s['last_value']:.4g}" if s["last_metric"] else ""
    return {
        "id": s["id"],
        "kind": s["kind"] or "",
        "model": model_name(s["model"]),
        "status": s["status"],
        "steps": steps,
        "last": last,
        "started": when(s["started"]),
        "duration": duration(s["duration_s"]),
    }

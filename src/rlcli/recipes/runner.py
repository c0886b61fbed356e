"""Running a cookbook recipe as a child process and showing its progress.

The recipe (``python -m rlcli.recipes.child <run_dir>``) writes the cookbook's usual files into
the run folder; its console output goes to ``console.log`` there. This side follows
``metrics.jsonl`` for progress (a bar on a terminal, plain lines otherwise), turns Ctrl-C into a
clean stop with the resume command, and turns a crash into one line (the child's
``rlcli-error:`` line, else the log's last lines).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlcli.errors import RlcliError

SPEC = "rlcli_spec.json"
SUMMARY = "rlcli_summary.json"
CONSOLE = "console.log"


@dataclass
class StepLine:
    step: int
    total: int
    values: dict[str, float]
    tokens_per_s: float | None
    eta_s: float | None

    def plain(self) -> str:
        parts = [f"step {self.step}/{self.total}"]
        parts += [f"{k} {v:.4g}" for k, v in self.values.items()]
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:.0f} tok/s")
        if self.eta_s is not None:
            parts.append(f"eta {self.eta_s:.0f}s")
        return "  ".join(parts)


def check_server(base_url: str, model: str) -> None:
    """One clear line if nothing answers at ``base_url`` (see ``endpoint.check_server``)."""
    from rlcli import endpoint

    endpoint.check_server(base_url.rstrip("/"), model=model)


def default_run_dir(kind: str) -> Path:
    from rlcli.home import rlcli_home

    return rlcli_home() / "runs" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_minimums(checks) -> None:
    """``checks``: (flag, value, lowest allowed) triples; the first one below its bound fails."""
    for flag, value, low in checks:
        if value < low:
            raise RlcliError(f"{flag} {value}: must be at least {low}")


def metric_values(run_dir: Path, *keys: str) -> dict[str, list[float]]:
    """Each key's numeric values, step by step, from the run's ``metrics.jsonl`` (read once)."""
    try:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    except FileNotFoundError:
        rows = []
    return {
        key: [float(r[key]) for r in rows if isinstance(r.get(key), int | float)] for key in keys
    }


def resume_command(command: str, options, run_dir: str) -> str:
    """The command that continues the run in ``run_dir`` with the same settings."""
    import dataclasses

    return command_line(command, dataclasses.replace(options, log_path=run_dir))


def command_line(command: str, options) -> str:
    """The ``rlcli`` command that reproduces ``options`` (a dataclass): every flag whose value
    differs from its default, so a resume runs with the same settings."""
    import dataclasses
    import shlex

    parts = command.split()
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if value is None or (f.default is not dataclasses.MISSING and value == f.default):
            continue
        parts += [f"--{f.name.replace('_', '-')}", str(value)]
    return shlex.join(parts)


def write_spec(run_dir: Path, spec: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SPEC).write_text(json.dumps(spec, indent=2) + "\n")


def run_recipe(
    run_dir: Path,
    total_steps: int,
    show: dict[str, str],
    resume_hint: str,
    report: Callable[[str], None],
    tokens_key: str = "num_tokens",
) -> dict:
    """Run the recipe in ``run_dir``; returns its summary. ``show`` maps metric keys to the
    labels printed per step (e.g. ``{"train_mean_nll": "loss"}``); ``tokens_key`` is the
    per-step token count behind tokens/s."""
    metrics = run_dir / "metrics.jsonl"
    seen = _count_lines(metrics)  # a resumed run already has rows
    (run_dir / SUMMARY).unlink(missing_ok=True)
    env = {**os.environ}
    env.setdefault("TINKER_API_KEY", "tml-dummy")
    env.setdefault("TINKER_TELEMETRY", "0")
    with (run_dir / CONSOLE).open("a") as console:
        child = subprocess.Popen(
            [sys.executable, "-m", "rlcli.recipes.child", str(run_dir)],
            stdout=console,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    first: tuple[int, float] | None = None  # (step, time) of the first row seen
    tokens_since_first = 0
    progress = _Progress(total_steps, report)
    try:
        while True:
            rows, seen = _new_rows(metrics, seen)
            for row in rows:
                step = int(row.get("step", 0)) + 1
                now = time.monotonic()
                if first is None:
                    first = (step, now)
                else:
                    tokens_since_first += int(row.get(tokens_key) or 0)
                steps_done, elapsed = step - first[0], now - first[1]
                per_step = elapsed / steps_done if steps_done else None
                progress.update(
                    StepLine(
                        step=step,
                        total=total_steps,
                        values={
                            label: float(row[key])
                            for key, label in show.items()
                            if isinstance(row.get(key), int | float)
                        },
                        tokens_per_s=tokens_since_first / elapsed if elapsed else None,
                        eta_s=per_step * (total_steps - step) if per_step else None,
                    )
                )
            if child.poll() is not None:
                rows, seen = _new_rows(metrics, seen)
                if not rows:
                    break
                continue
            time.sleep(0.25)
    except KeyboardInterrupt:
        progress.close()
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGINT)
        try:
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            child.kill()
        raise RlcliError(
            f"stopped. Resume from the last checkpoint with:\n  {resume_hint}"
        ) from None
    progress.close()
    if child.returncode != 0:
        raise RlcliError(_failure(run_dir, child.returncode))
    try:
        return json.loads((run_dir / SUMMARY).read_text())
    except FileNotFoundError:
        raise RlcliError(_failure(run_dir, child.returncode)) from None


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


class _Progress:
    """A Rich bar on a terminal; one plain line per step otherwise (logs, CI, pipes)."""

    def __init__(self, total: int, report: Callable[[str], None]) -> None:
        self.report = report
        self.bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[line]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.task = self.bar.add_task("train", total=total, line="")
            self.bar.start()

    def update(self, line: StepLine) -> None:
        if self.bar is None:
            self.report(line.plain())
            return
        text = "  ".join(f"{k} {v:.4g}" for k, v in line.values.items())
        if line.tokens_per_s:
            text += f"  {line.tokens_per_s:.0f} tok/s"
        self.bar.update(self.task, completed=line.step, line=text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

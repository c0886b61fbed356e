"""What a running recipe shows: one line per step, and what it is doing between steps.

Steps come from the cookbook's ``metrics.jsonl``; the phases in between (starting, sampling
rollouts k/N, saving a checkpoint, the held-out loss) from ``rlcli_status.jsonl``, to which the
child process appends one line per event (``child.py`` and the hooks in
``compat/run_hooks.py``): a log, not a snapshot, so a phase shorter than one poll is still
shown. On a terminal this is a Rich bar; otherwise (logs, CI, pipes) plain lines.

Rates are measured between polls, never between rows read in the same poll (they share one
timestamp, which once gave ``1676397 tok/s eta 0s``), and only once a few seconds have passed.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STATUS = "rlcli_status.jsonl"
MIN_RATE_WINDOW_S = 2.0  # below this, a rate is noise


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


class Rates:
    """Tokens/s and seconds per step over the polls since the first one that saw a step."""

    def __init__(self) -> None:
        self.base: tuple[float, int, int] | None = None  # (time, tokens, step) after first poll
        self.tokens = 0
        self.step = 0

    def add(self, step: int, tokens: int) -> None:
        self.step, self.tokens = step, self.tokens + tokens

    def end_poll(self, now: float) -> None:
        if self.base is None:
            self.base = (now, self.tokens, self.step)

    def current(self, now: float, total: int) -> tuple[float | None, float | None]:
        """(tokens/s, eta s), or None for what cannot be measured yet."""
        if self.base is None:
            return None, None
        t0, tokens0, step0 = self.base
        elapsed, steps = now - t0, self.step - step0
        if elapsed < MIN_RATE_WINDOW_S or steps < 1:
            return None, None
        tokens_per_s = (self.tokens - tokens0) / elapsed if self.tokens > tokens0 else None
        return tokens_per_s, elapsed / steps * max(total - self.step, 0)


def read_rows(path: Path, seen: int) -> tuple[list[dict], int]:
    """The JSONL rows of ``path`` after its first ``seen`` lines, and the lines read so far.

    Only whole lines count: one still being written (no newline yet) is left for the next read.
    A whole line that does not parse is skipped, and said once: a run killed mid-write leaves a
    torn line, which the resumed run's first row then completes; the rows after it stand (the
    old reader stopped there, freezing progress and step counts)."""
    try:
        lines = path.read_text(errors="replace").split("\n")[:-1]
    except FileNotFoundError:
        return [], seen
    rows = []
    for number, line in enumerate(lines[seen:], start=seen + 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            _say_torn(path, number)
            continue
        rows.append(row if isinstance(row, dict) else {})
    return rows, max(seen, len(lines))


_TORN: set[tuple[str, int]] = set()


def _say_torn(path: Path, number: int) -> None:
    if (str(path), number) not in _TORN:
        _TORN.add((str(path), number))
        sys.stderr.write(f"note: {path} line {number} is torn (a write cut short); skipped\n")


def count_lines(path: Path) -> int:
    try:
        with path.open() as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def read_events(run_dir: Path, seen: int) -> tuple[list[dict], int]:
    """The status events after the first ``seen`` lines, and the new count."""
    try:
        lines = (run_dir / STATUS).read_text().splitlines()
    except FileNotFoundError:
        return [], seen
    events = []
    for line in lines[seen:]:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # still being written: read it next time
            break
        events.append(event if isinstance(event, dict) else {})
    return events, seen + len(events)


def describe_status(status: dict) -> str | None:
    """One short line for a phase: ``sampling rollouts 24/64 (step 3)``."""
    phase = status.get("phase")
    if not phase or phase == "done":
        return None
    if "done" in status and "total" in status:
        text = f"{phase} {status['done']}/{status['total']}"
    else:
        text = str(phase)
    if status.get("step") is not None:
        text += f" (step {int(status['step']) + 1})"
    return text


class Progress:
    """A Rich bar on a terminal (``tty``); one plain line per step and phase otherwise."""

    PLAIN_PHASE_EVERY_S = 5.0  # plain mode: a changing count (rollouts) at most this often

    def __init__(self, total: int, report: Callable[[str], None], tty: bool | None = None):
        self.report = report
        self.total = total
        self.bar = None
        self._last_phase: str | None = None
        self._last_phase_name: str | None = None
        self._last_phase_at = 0.0
        if sys.stderr.isatty() if tty is None else tty:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[line]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.task = self.bar.add_task("train", total=total, line="starting")
            self.bar.start()

    def update(self, line: StepLine) -> None:
        if self.bar is None:
            self.report(line.plain())
            return
        text = "  ".join(f"{k} {v:.4g}" for k, v in line.values.items())
        if line.tokens_per_s:
            text += f"  {line.tokens_per_s:.0f} tok/s"
        self.bar.update(self.task, completed=line.step, line=text)

    def phases(self, events: list[dict]) -> None:
        """Show each new phase in order; of a run of counts (rollouts k/N), only the last."""
        for i, event in enumerate(events):
            following = events[i + 1] if i + 1 < len(events) else None
            if following and "done" in event and following.get("phase") == event.get("phase"):
                continue
            self.phase(event)

    def phase(self, status: dict) -> None:
        """What the run is doing now (between steps), from ``rlcli_status.jsonl``."""
        text = describe_status(status)
        if not text or text == self._last_phase:
            return
        if self.bar is not None:
            self._last_phase = text
            self.bar.update(self.task, line=text)
            return
        name = status.get("phase")
        now = time.monotonic()
        counting = name == self._last_phase_name and "done" in status
        if counting and now - self._last_phase_at < self.PLAIN_PHASE_EVERY_S:
            return  # plain mode: a changing count at most every few seconds
        self._last_phase, self._last_phase_name, self._last_phase_at = text, name, now
        self.report(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class Follower:
    """Follows a run folder: new ``metrics.jsonl`` rows become step lines (``show``: metric key
    -> label), new status events the phase between steps. Used by the runner while it runs the
    recipe, and by ``rlcli runs show --follow`` for a run another process runs."""

    def __init__(
        self,
        run_dir: Path,
        total: int,
        show: dict[str, str],
        report: Callable[[str], None],
        tokens_key: str = "num_tokens",
        tty: bool | None = None,
    ) -> None:
        self.run_dir, self.total, self.show, self.tokens_key = run_dir, total, show, tokens_key
        self.metrics = run_dir / "metrics.jsonl"
        self.seen = count_lines(self.metrics)  # a resumed run already has rows
        self.events_seen = count_lines(run_dir / STATUS)
        self.progress = Progress(total, report, tty=tty)
        self.rates = Rates()

    def poll(self) -> int:
        """Show what is new; returns the number of new steps."""
        rows, self.seen = read_rows(self.metrics, self.seen)
        now = time.monotonic()
        for row in rows:
            self.rates.add(int(row.get("step", 0)) + 1, int(row.get(self.tokens_key) or 0))
        for i, row in enumerate(rows):
            step = int(row.get("step", 0)) + 1
            last = i == len(rows) - 1
            tokens_per_s, eta = self.rates.current(now, self.total) if last else (None, None)
            values = {
                label: float(row[key])
                for key, label in self.show.items()
                if isinstance(row.get(key), int | float)
            }
            self.progress.update(StepLine(step, self.total, values, tokens_per_s, eta))
        if rows:
            self.rates.end_poll(now)
        if self.events_seen and count_lines(self.run_dir / STATUS) < self.events_seen:
            self.events_seen = 0  # a new attempt started the status log again
        events, self.events_seen = read_events(self.run_dir, self.events_seen)
        self.progress.phases(events)
        return len(rows)

    def close(self) -> None:
        self.progress.close()

"""How long a run took, part by part, and what that predicts for a run of another length.

The runner times every run it drives (``StepClock``): from its start to the first step (the
recipe child's start, tokenizer and data, the first step with its warm-up), each step after
that, and from the last step to the child's exit (the final checkpoint and the summary). The
run's record keeps the result (``timing``), so later dry runs can reuse it, and ``predict``
turns it into a wall time for a run of N steps with a range. ``train --dry-run``'s estimate is
built here from a short calibration or an earlier run (``recipes/estimate.py``).
"""

from __future__ import annotations

import os
import statistics
import time


class StepClock:
    """Times the steps of one run as the runner sees them arrive in ``metrics.jsonl``."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.first: float | None = None  # when the first step arrived
        self.last: float | None = None
        self.intervals: list[float] = []  # seconds per step after the first
        self.steps = 0
        self.looked = self.start  # the runner's previous look at metrics.jsonl
        self.ended: float | None = None

    def steps_arrived(self, count: int, now: float | None = None) -> None:
        """``count`` new steps seen at ``now``; called at every look, with 0 when none came.
        Several steps at once share the time since the look before: the first step's arrival
        ends the start-up, and the steps seen with it finished after the previous look."""
        now = time.monotonic() if now is None else now
        if count > 0:
            if self.first is None:
                self.first = now
                # A short run's steps can all arrive in one look: without this share they
                # would give no interval at all (issue 46: a 3-step calibration then took a
                # step to be half the start-up, 10x the real step)
                self.intervals += [(now - self.looked) / count] * (count - 1)
            else:
                self.intervals += [(now - self.last) / count] * count
            self.steps += count
            self.last = now
        self.looked = now

    def end(self, now: float | None = None) -> None:
        self.ended = time.monotonic() if now is None else now

    def summary(self) -> dict | None:
        """What the record keeps; None before a first step."""
        if self.first is None or self.last is None:
            return None
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        return {
            "startup_s": round(self.first - self.start, 3),
            "step_s": _spread(self.intervals),
            "finish_s": round((self.ended or self.last) - self.last, 3),
            "steps": self.steps,
            "load": round(load, 2) if load is not None else None,
            "cpus": os.cpu_count(),
            "when": time.time(),
        }


def _spread(values: list[float]) -> dict | None:
    """Mean, median, fastest and slowest of the per-step times (None: one step, no interval).
    Steps faster than the runner's poll arrive together and share its interval: the mean is
    exact, the others are as fine as the poll (0.25 s)."""
    if not values:
        return None
    return {
        "mean": round(statistics.fmean(values), 4),
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


FIXED_SPREAD = 0.25  # start-up and saves are measured once: +-25% of them in the range


def predict(timing: dict, steps: int, save_every: int, prepare_s: float = 0.0) -> dict:
    """Wall time of a run of ``steps`` steps from a measured ``timing`` (``StepClock``):
    ``prepare_s`` (the command's checks before the recipe starts), the start-up with its first
    step, each further step at the mean, a periodic save every ``save_every`` steps (each
    costing what the final save did), then the final save. ``low``/``high`` take the fastest
    and slowest measured step instead (with one step measured, +-25%), and the parts measured
    once (start-up, saves) +-``FIXED_SPREAD``."""
    spread = timing.get("step_s") or {}
    per_step = spread.get("mean", spread.get("median"))
    startup, finish = float(timing["startup_s"]), float(timing["finish_s"])
    if per_step is None:  # one step was measured: its time, with the start-up in it, is all
        per_step = startup / 2
        low_step, high_step = 0.75 * per_step, 1.25 * per_step
    else:
        low_step, high_step = spread["min"], spread["max"]
    saves = (steps - 1) // save_every if save_every else 0
    fixed = prepare_s + startup + finish * (1 + saves)
    later = max(0, steps - 1)
    return {
        "seconds": round(fixed + later * per_step, 1),
        "low": round(fixed * (1 - FIXED_SPREAD) + later * low_step, 1),
        "high": round(fixed * (1 + FIXED_SPREAD) + later * high_step, 1),
        "per_step_s": round(per_step, 3),
        "startup_s": round(prepare_s + startup, 1),
        "saves": saves + 1,
        "save_s": round(finish, 1),
    }


def human(seconds: float) -> str:
    """``2 min 05 s``, ``40 s``, ``1 h 10 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"

"""How many RL steps the demo runs on this machine, and whether its reward rose.

The RL phase shows learning only with enough steps: on 2 quiet cores SmolLM2's reward rises
from ~0.5 to ~0.8 over 24 steps, while 6 steps on a busy machine fell 0.57 -> 0.40. So the
RL phase keeps its steps and the time budget gives way: after SFT the machine's speed is known
(an RL step costs about ``RL_PER_SFT_STEP`` SFT steps, measured on SmolLM2 and refined by every
RL step taken), and when the steps do not fit in ``--minutes`` the budget is stretched, up to
``STRETCH`` times, and the demo says so before it starts the RL phase. Only a machine too slow
even for that gets fewer steps, and then ``verdict`` says plainly that no rise could be shown.
The clock is a parameter, so the logic is tested on a fake one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# On 2 CPU cores (benchmarks/results/demo_smollm2.json) an RL step (4 prompts x 4 answers of up
# to 48 tokens, then one update) took 10-17 s where an SFT step (8 conversations) took 3.4-4.6 s.
RL_PER_SFT_STEP = 3.5
STRETCH = 3.0  # the budget may grow to this many times --minutes so that RL gets its steps
# verdict: the mean reward of the last third of the steps against the first third
RISE = 0.1  # a rise at least this large (rewards are 0..1) is learning, not noise
MIN_STEPS_TO_TELL = 6


@dataclass
class RLBudget:
    """The RL phase's step count and when to stop it: ``deadline`` ends the budget
    (``--minutes``, less what still follows), ``hard`` the stretched one; monotonic seconds."""

    steps: int
    deadline: float
    hard: float
    started: float
    reserve_s: float
    clock: Callable[[], float] = time.monotonic
    taken: list[float] = field(default_factory=list)  # seconds per RL step so far
    planned: int = 0
    stretched: bool = False

    @classmethod
    def for_budget(
        cls, steps: int, started: float, minutes: float, reserve_s: float, clock=time.monotonic
    ) -> RLBudget:
        """``reserve_s``: what still follows the RL phase (the answers afterwards)."""
        end = started + minutes * 60 - reserve_s
        hard = started + STRETCH * minutes * 60 - reserve_s
        return cls(steps, end, hard, started, reserve_s, clock)

    def plan(self, sft_step_s: float) -> str:
        """Size the phase from the SFT steps' mean time; one line saying what was decided."""
        step_s = RL_PER_SFT_STEP * sft_step_s
        now = self.clock()
        fits = int(max(0.0, self.deadline - now) // step_s)
        fits_stretched = int(max(0.0, self.hard - now) // step_s)
        need = self.steps * step_s
        if fits >= self.steps:
            self.planned = self.steps
            return (
                f"RL: {self.steps} steps, about {need / 60:.1f} min at this machine's speed "
                f"(SFT steps took {sft_step_s:.1f} s)"
            )
        past = (now + need - self.deadline) / 60
        if fits_stretched >= self.steps:
            self.planned, self.stretched = self.steps, True
            return (
                f"RL: {self.steps} steps take about {need / 60:.1f} min here (SFT steps took "
                f"{sft_step_s:.1f} s): the reward needs them all to show a rise, so the demo "
                f"runs about {past:.1f} min past --minutes"
            )
        self.planned, self.stretched = max(1, fits_stretched), True
        return (
            f"RL: this machine is too slow for {self.steps} steps even at {STRETCH:g}x "
            f"--minutes (SFT steps took {sft_step_s:.1f} s, so an RL step about {step_s:.0f} s); "
            f"running {self.planned}, which may be too few to show a rise (more time: "
            f"--minutes {math.ceil(self.minutes_needed(step_s))})"
        )

    def minutes_needed(self, step_s: float) -> float:
        """The --minutes that fits every RL step at ``step_s`` without stretching."""
        return (self.clock() - self.started + self.steps * step_s + self.reserve_s) / 60

    def keep_going(self, step: int) -> bool:
        """Before RL step ``step`` (0-based): whether to take it. The stretched end is the
        limit (steps slower than planned stretch the budget too); the phase stops where its
        next step, at the mean so far, would pass it."""
        if step >= self.planned:
            return False
        if step < 2 or not self.taken:
            return True
        mean = sum(self.taken) / len(self.taken)
        return self.clock() + mean <= self.hard

    def overrun(self) -> str | None:
        """Once, when an unstretched phase passes --minutes: the line saying so."""
        if self.stretched or self.clock() <= self.deadline:
            return None
        self.stretched = True
        return "RL: past --minutes; finishing the planned steps (the reward needs them)"

    def took(self, seconds: float) -> None:
        self.taken.append(seconds)


def verdict(rewards: list[float]) -> dict:
    """Did the RL reward rise? The mean of the first third of the steps against the last
    third: ``rose`` (by ``RISE`` or more), else not; with fewer than ``MIN_STEPS_TO_TELL`` steps
    it cannot tell. ``says`` is the line the report prints."""
    n = len(rewards)
    if n < MIN_STEPS_TO_TELL:
        return {
            "rose": None,
            "says": f"{n} RL steps: too few to tell whether the reward rises "
            f"(it needs {MIN_STEPS_TO_TELL} or more; about 24 show it)",
        }
    third = max(2, n // 3)
    first, last = _mean(rewards[:third]), _mean(rewards[-third:])
    rose = last - first >= RISE
    span = f"{first:.2f} -> {last:.2f} (mean of the first and last {third} of {n} steps)"
    if rose:
        return {"rose": True, "first": first, "last": last, "says": f"rose {span}"}
    return {
        "rose": False,
        "first": first,
        "last": last,
        "says": f"did not rise: {span}; not a result (too few steps or too little learning "
        "in this setting)",
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)

"""``train --dry-run``'s estimate of the wall time, and where it came from.

Two sources, in this order, and the estimate names the one it used:

- measured rates: the timing (``runs/timing.py``) of the latest earlier run of the same command
  with the same settings on the same server (only the learning rate, seed, length and saving
  may differ), as its record keeps it; costs nothing, but reflects that run's load;
- a calibration: the run's own recipe, with its data, for ``CALIBRATION_STEPS`` steps on the
  server, in a scratch folder that is removed afterwards (the server's checkpoint of it too).
  It measures the start-up, the steps and a save under the load of now, at the cost of a
  short run (the tiny model: seconds; SmolLM2 on a CPU: about a minute; steps after the first
  stop at the first step boundary past ``CALIBRATION_MINUTES``).

Either way ``timing.predict`` extrapolates to the plan's steps with a range from the fastest
and slowest step measured. Steps whose length changes while training (RL answers grow or
shrink) and a load that changes are what the range cannot see; the estimate says so. No
server and no earlier run: no estimate, and the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from pathlib import Path

from rlcli import flags
from rlcli.client import endpoint
from rlcli.errors import RlcliError, RunFailed
from rlcli.recipes import options
from rlcli.recipes.base import Plan, Recipe
from rlcli.runs import catalog, folder, runner, timing
from rlcli.runs.progress import StepLine

CALIBRATION_STEPS = 3
# After its first step, the calibration stops at the first step boundary past this.
CALIBRATION_MINUTES = 1.0
# Settings that do not change how long a step takes: runs differing only in these share rates.
NOT_SHAPING = frozenset(
    {"lr", "seed", "max_steps", "epochs", "save_every", "lr_schedule",
     "warmup_steps", "wandb_project", "wandb_name", "log_path"}
)  # fmt: skip
POLICY_NOTE = "RL steps take longer or shorter as the answers' length changes while training"


def estimate(recipe: Recipe, opts, plan: Plan, data, url: str, source: str, prepare_s, say):
    """The estimate for ``plan`` (``opts``: resolved), as a dict for the dry run's output:
    ``seconds``, ``low``, ``high``, ``from`` (which source, with its load), ``note``; or
    ``seconds`` None and ``why`` when there is nothing to estimate from."""
    steps = plan.steps - _steps_held(Path(plan.run_dir)) if plan.resuming else plan.steps
    earlier = earlier_timing(recipe, opts)
    if earlier is not None:
        measured, run_dir = earlier
        basis = f"the measured rates of run {run_dir.name} ({_load(measured)})"
    else:
        try:
            endpoint.check_server(url, model=opts.model, source=source, timeout=3.0)
        except RlcliError as e:
            return {"seconds": None, "why": f"no earlier run of these settings and {e}"}
        say(f"estimate: calibrating {min(steps, CALIBRATION_STEPS)} steps on {url}")
        try:
            measured = calibrate(recipe, opts, plan, data, url, say)
        except RlcliError as e:
            return {"seconds": None, "why": f"the calibration failed: {e}"}
        cal = f"{measured['steps']}-step calibration"
        basis = f"a {cal} on {url} just now ({_load(measured)})"
    out = {**timing.predict(measured, max(steps, 1), opts.save_every, prepare_s), "from": basis}
    if opts.max_minutes and out["seconds"] > opts.max_minutes * 60:
        done = int((opts.max_minutes * 60 - out["startup_s"]) / max(out["per_step_s"], 1e-3))
        out["max_minutes"] = (
            f"--max-minutes {opts.max_minutes:g} stops it after about {max(1, done)} of "
            f"{steps} steps"
        )
    out["note"] = (
        "the range: the fastest and slowest step measured, start-up and saves +-25%; "
        "a change in the machine's load moves it"
    )
    if hasattr(opts, "group_size"):
        out["note"] += f"; {POLICY_NOTE}"
    return out


def calibrate(recipe: Recipe, opts, plan: Plan, data, url: str, say) -> dict:
    """Run the recipe for a few steps in a scratch folder against ``url``; its timing. The
    folder and the checkpoint the steps saved on the server are removed afterwards."""
    steps = min(plan.steps, CALIBRATION_STEPS)
    scratch = Path(tempfile.mkdtemp(prefix="rlcli-estimate-"))
    given = dataclasses.replace(
        opts, log_path=str(scratch), max_steps=steps, save_every=0, max_minutes=None,
        wandb_project=None, wandb_name=None, dry_run=False, detach=False,
    )  # fmt: skip
    try:
        with recipe.around(given, say) as cal_opts:
            cal_opts = _moved(cal_opts, plan.run_dir, scratch)
            cal_plan = dataclasses.replace(
                _moved(plan, plan.run_dir, scratch), steps=steps, resuming=False
            )
            runner.lock_run_dir(scratch)
            recipe.commit(cal_opts, cal_plan, data)
            runner.write_spec(scratch, recipe.spec(cal_opts, cal_plan))
            runner.run_recipe(
                scratch, total_steps=steps, show={}, resume_hint="", report=_Quiet(say, steps),
                tokens_key=recipe.tokens_key, base_url=url, max_minutes=CALIBRATION_MINUTES,
                limit_after_first_step=True,
            )  # fmt: skip
        measured = (folder.read_record(scratch) or {}).get("timing")
        if not measured:
            raise RlcliError("it made no step")
        _delete_checkpoints(scratch, url)
        return measured
    except RunFailed as e:
        if e.exit_code != 1:  # a signal (Ctrl-C): stop here, as the run would
            raise RlcliError(f"the estimate's calibration was {e.error}", e.exit_code) from None
        raise RlcliError(e.error) from None
    finally:
        runner.release_run_dir(scratch)
        shutil.rmtree(scratch, ignore_errors=True)


def earlier_timing(recipe: Recipe, opts) -> tuple[dict, Path] | None:
    """The timing of the latest earlier run of ``recipe`` with ``opts``' step-shaping
    settings (all but ``NOT_SHAPING``), and its folder; None if there is none."""
    ours = {k: v for k, v in flags.saved(opts).items() if k not in NOT_SHAPING}
    best: tuple[dict, Path] | None = None
    for run_dir in catalog.discover():
        measured = (folder.read_record(run_dir) or {}).get("timing")
        if not measured or not measured.get("step_s"):
            continue
        found = options.folder_command(run_dir)
        if found is None or found[0] != recipe.command:
            continue
        theirs = {k: v for k, v in found[1].items() if k not in NOT_SHAPING}
        if theirs.keys() != ours.keys():
            continue
        if not all(_same(ours[k], theirs[k]) for k in ours):
            continue
        if best is None or measured.get("when", 0) > best[0].get("when", 0):
            best = (measured, run_dir)
    return best


def _same(a, b) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _moved(obj, old: str, new: Path):
    """``obj`` (a plan or options dataclass) with every path inside ``old`` moved to ``new``
    (the data a run keeps in its folder, e.g. stdin's)."""
    old = str(Path(old))
    changed = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, str) and (value == old or value.startswith(old + "/")):
            changed[f.name] = str(new) + value[len(old) :]
    return dataclasses.replace(obj, **changed)


def _steps_held(run_dir: Path) -> int:
    """Steps the run folder's last checkpoint holds (a resume trains the rest)."""
    name = str((runner.last_checkpoint(run_dir) or {}).get("name", "0"))
    return int(name) if name.isdigit() else 0


def _load(measured: dict) -> str:
    load, cpus = measured.get("load"), measured.get("cpus")
    return f"load {load:g} on {cpus} cores" if load is not None else "load unknown"


def _delete_checkpoints(run_dir: Path, url: str) -> None:
    """Best effort: the calibration's checkpoints go from the server's store."""
    paths = {
        row[key]
        for row in folder.checkpoint_rows(run_dir)
        for key in ("state_path", "sampler_path")
        if row.get(key)
    }
    if not paths:
        return
    import tinker

    with contextlib.suppress(Exception):
        rest = tinker.ServiceClient(base_url=url, api_key=endpoint.api_key()).create_rest_client()
        for path in paths:
            with contextlib.suppress(Exception):
                rest.delete_checkpoint_from_tinker_path(path).result()


class _Quiet:
    """The calibration's progress: one line per step, nothing else."""

    def __init__(self, say, total: int) -> None:
        self.say, self.total = say, total

    def message(self, text: str) -> None:
        pass

    def step(self, line: StepLine) -> None:
        self.say(f"estimate: calibration step {line.step}/{self.total}")

    def phase(self, status: dict) -> None:
        pass

    def checkpoint(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass

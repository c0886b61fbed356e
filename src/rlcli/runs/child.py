"""``python -m rlcli.runs.child RUN_DIR``: run the recipe a spec describes (see runner.py).

First it ties its life to the ``rlcli`` process that started it: the kernel kills it when that
process dies (``PR_SET_PDEATHSIG``, checked against ``getppid`` right after, in case the parent
died before the call), so a killed ``rlcli`` never leaves a recipe writing to the run folder.
Then it installs the compat hooks (exact SL resume, progress) and reports what it is doing in
``rlcli_status.jsonl`` from its first second. A failure ends with one ``rlcli-error:`` line
(the exception, and where the full log is), which the parent shows as the error. A
``rlcli runs cancel`` request ends the recipe at the next step boundary, after a checkpoint,
with exit code ``CANCELLED_EXIT``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from rlcli import recipes
from rlcli.compat import run_hooks, skyrl_client
from rlcli.compat.run_hooks import RunCancelled
from rlcli.launch.pids import die_with_parent
from rlcli.recipes.options import lora_switches
from rlcli.runs.folder import CANCEL, CONSOLE, ERROR_PREFIX, SPEC, SUMMARY, append_status
from rlcli.runs.runner import CANCELLED_EXIT, PARENT_PID_ENV


def tie_to_parent() -> None:
    """Die with the parent ``rlcli`` (SIGKILL from the kernel); exit now if it is gone."""
    expected = os.environ.get(PARENT_PID_ENV)
    die_with_parent(signal.SIGKILL)
    if expected and os.getppid() != int(expected):
        sys.exit(1)  # the parent died before prctl: nobody is watching this run


class StatusFile:
    """``rlcli_status.jsonl``: one line per phase or count, appended (the parent follows it)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def __call__(self, phase: str, **fields) -> None:
        append_status(self.run_dir, phase, **fields)


def cancel_requested(run_dir: Path):
    """Whether ``rlcli runs cancel`` asked this run to stop: ``rlcli_cancel`` names the pid of
    the ``rlcli`` process that runs it (a request left from an earlier attempt names another)."""
    path, parent = run_dir / CANCEL, os.environ.get(PARENT_PID_ENV)

    def requested() -> bool:
        try:
            request = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(request, dict) and str(request.get("pid")) == parent

    return requested


def main(run_dir: str) -> int:
    tie_to_parent()
    try:
        return _run(Path(run_dir))
    except Exception as e:  # the full traceback stays in console.log; the user gets one line
        if isinstance(e, RunCancelled):
            StatusFile(Path(run_dir))("cancelled", step=e.step)
            print(f"rlcli-cancelled: {json.dumps(e.paths)}", flush=True)
            return CANCELLED_EXIT
        import traceback

        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:500]
        print(
            f"{ERROR_PREFIX}the run failed with {type(e).__name__}: {first} "
            f"(details: {Path(run_dir) / CONSOLE})",
            flush=True,
        )
        return 1


def _run(folder: Path) -> int:
    status = StatusFile(folder)
    status("starting: loading the model's tokenizer and the data")
    spec = json.loads((folder / SPEC).read_text())

    after = "writing the summary"
    if spec["recipe"] == "sl" and (spec.get("plan") or {}).get("held_out"):
        after = "evaluating the held-out loss"

    cancelling = []

    def report(phase: str, **fields) -> None:
        if phase.startswith("cancelling"):
            cancelling.append(True)
        elif phase == "recipe finished" and cancelling:
            return  # no summary follows a cancel
        status(after if phase == "recipe finished" else phase, **fields)

    from rlcli.compat import renderers, tokenizers

    renderers.register()  # the model's own chat template, if the plan chose it
    options = spec.get("options") or {}
    tokenizers.register(options.get("model"), options.get("teacher"))
    run_hooks.install_cancel_hook(cancel_requested(folder), report)  # first: see run hooks
    run_hooks.install_run_hooks(report, seed=int((spec.get("options") or {}).get("seed") or 0))
    skyrl_client.release_adapters_at_exit()  # SkyRL holds a LoRA slot per client until its timeout
    skyrl_client.accept_unnumbered_samples()  # SkyRL answers samples the 0.25 way
    settings = spec.get("options") or {}
    run_hooks.send_lora_config(
        settings.get("lora_alpha"), lora_switches(settings.get("lora_targets"))
    )

    try:
        recipe = recipes.get(spec["recipe"])
    except KeyError:
        print(f"rlcli-error: unknown recipe {spec['recipe']!r}", flush=True)
        return 2
    status("starting: connecting to the server")
    summary = recipe.run_in_child(spec)
    (folder / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    status("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

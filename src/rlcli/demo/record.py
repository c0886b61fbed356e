"""The demo's run folder, kept like a train run's so ``rlcli runs list/show/plot`` see it.

The folder is made when the first step is about to run (not before: a demo stopped while its
model converts or its server starts leaves nothing behind) and holds the run's record
(``rlcli_run.json``: running, then finished / interrupted / failed), its lock while it runs,
and a ``metrics.jsonl`` row per SFT and RL step (``--loop``: per learn round). A demo stopped
before its first step was recorded removes the folder it made.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from rlcli.errors import RlcliError
from rlcli.runs import runner
from rlcli.runs.folder import METRICS_FILE


class DemoFolder:
    """``open`` once the steps start, ``row`` per step, ``close`` with how it ended."""

    def __init__(
        self, run_dir: Path, model: str, total_steps: int, options: dict | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.model, self.total_steps = model, total_steps
        self.options = {"model": model, **(options or {})}
        self.made = False  # this demo created the folder (so may remove it)
        self.record: dict | None = None
        self.rows = 0

    def open(self) -> None:
        if self.record is not None:
            return
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RlcliError(f"--log-path {self.run_dir}: exists and is not a folder")
        self.made = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        runner.lock_run_dir(self.run_dir)
        (self.run_dir / METRICS_FILE).unlink(missing_ok=True)  # a demo folder reused
        spec = {"recipe": "demo", "options": self.options}
        self.record = runner.start_record(self.run_dir, spec, self.total_steps, None)

    def row(self, metrics: dict) -> None:
        self.open()
        with (self.run_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        self.rows += 1

    def close(self, status: str, code: int, error: str | None) -> None:
        """Record how it ended; a folder this demo made and wrote no step into goes."""
        if self.record is None:
            return
        if self.rows == 0 and self.made:
            runner.release_run_dir(self.run_dir)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return
        with contextlib.suppress(OSError):
            runner.end_record(self.run_dir, self.record, status, code, error)
        runner.release_run_dir(self.run_dir)

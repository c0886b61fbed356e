"""Harbor's reward, with the failures said: upload ``tests/`` to ``/tests``, run
``bash /tests/test.sh`` (from ``/root``), read ``/logs/verifier/reward.txt`` (a number) or
``reward.json`` (``{"reward": x}``).

The cookbook's ``HarborReward`` does the same but a verifier that writes no reward only gets a
warning; here a broken verifier (no reward file, an unreadable one, a timeout, a dead
container) is reward 0 with ``grading_error`` 1 in the metrics and one logged error naming the
task and test.sh's exit code and last stderr line, and the run goes on.
``compat/harbor_hooks.py`` installs ``Verifier`` as the harbor recipe's reward.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("rlcli.harbor")

REWARD_DIR = "/logs/verifier"


def _last(text: str) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1][:300] if lines else ""


async def upload_tests(sandbox, tests_dir: Path) -> None:
    """Every file under ``tests_dir`` (nested folders kept) into ``/tests``."""
    await sandbox.run_command("mkdir -p /tests", workdir="/")
    for path in sorted(Path(tests_dir).rglob("*")):
        if path.is_file():
            target = f"/tests/{path.relative_to(tests_dir)}"
            result = await sandbox.write_file(
                target, path.read_bytes(), executable=path.suffix == ".sh"
            )
            if result.exit_code != 0:
                raise RuntimeError(f"upload of {target} failed: {_last(result.stderr)}")


async def read_reward(sandbox) -> float | None:
    """The reward test.sh wrote, or None when it wrote none; ValueError when unreadable."""
    result = await sandbox.read_file(f"{REWARD_DIR}/reward.txt")
    if result.exit_code == 0 and result.stdout.strip():
        value = float(result.stdout.strip())
    else:
        result = await sandbox.read_file(f"{REWARD_DIR}/reward.json")
        if result.exit_code != 0 or not result.stdout.strip():
            return None
        value = float(json.loads(result.stdout).get("reward", 0.0))
    if not math.isfinite(value):
        raise ValueError(f"reward {value} is not a finite number")
    return value


async def verify(sandbox, tests_dir: Path, timeout: int = 60, task: str = "") -> tuple[float, dict]:
    """(reward, metrics) of the sandbox's current state; never raises."""
    name = task or Path(tests_dir).parent.name
    code = None
    try:
        await upload_tests(sandbox, tests_dir)
        await sandbox.run_command(f"rm -rf {REWARD_DIR} && mkdir -p {REWARD_DIR}", workdir="/")
        result = await sandbox.run_command("bash /tests/test.sh", workdir="/root", timeout=timeout)
        code = result.exit_code
        reward = await read_reward(sandbox)
        if reward is None:
            detail = _last(result.stderr) or _last(result.stdout) or "no output"
            raise RuntimeError(
                f"test.sh exited {code} and wrote no {REWARD_DIR}/reward.txt or reward.json "
                f"({detail})"
            )
    except Exception as e:
        logger.error("harbor verifier failed for task %s: %s", name, e)
        return 0.0, {"reward": 0.0, "test_passed": 0.0, "grading_error": 1.0}
    return reward, {"reward": reward, "test_passed": float(reward > 0), "grading_error": 0.0}


@dataclass
class Verifier:
    """The recipe's per-sandbox reward function (the cookbook's ``HarborReward`` signature:
    ``tests_dir``, ``sandbox``, ``grader_timeout``; called with the episode's messages)."""

    tests_dir: Path
    sandbox: object
    grader_timeout: int = 60

    async def __call__(self, history) -> tuple[float, dict[str, float]]:
        task = getattr(self.sandbox, "task", None)
        timeout = max(self.grader_timeout, getattr(task, "verifier_timeout_s", 0) or 0)
        return await verify(self.sandbox, self.tests_dir, timeout)

"""`rlcli train harbor` on the example tasks with the tiny model: rollouts per minute, where a
step's time goes (container start/removal, commands, policy sampling, training), and the
container start time with a warm image cache (target: under 1 s per rollout).

Three parts, one receipt:

1. ``train``: the real command against our server, ``--groups-per-batch 1`` (one task per step,
   so the 3 example tasks make 3 steps) and ``--group-size 4``. Step times and the training
   share come from the cookbook's ``metrics.jsonl``; per-container times (start, commands,
   removal) from the sandbox's ``harbor_sandbox.jsonl``. Rollouts of a group run concurrently,
   so the per-rollout parts are summed over rollouts ("rollout-seconds") and given as shares
   of that sum, beside the step's wall-clock split (rollout phase vs training).
2. ``container_start``: ``DockerSandbox.create`` + ``cleanup`` one after another, image cached.
3. ``verifier``: each example task's solution and verifier (upload ``tests/``, ``test.sh``,
   read the reward) in a fresh container: the cost of commands when a model does act.

Needs a Docker daemon (``sudo .ci/docker-up.sh``).

    .venv/bin/python benchmarks/harbor_rollouts.py [--group-size 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "harbor-tasks"


def _total(row: dict, key: str) -> float:
    """A timed span's total in a metrics row (``key:total`` when it ran several times)."""
    return float(row.get(f"{key}:total", row.get(key, 0.0)))


def train(args, model: Path, tmp: str) -> dict:
    run_dir = Path(tmp) / "run"
    with _receipt.local_server(model, tmp) as record:
        command = [
            sys.executable, "-m", "rlcli.cli.main", "train", "harbor",
            "--model", str(model), "--base-url", record.base_url, "--dataset", str(EXAMPLES),
            "--group-size", str(args.group_size), "--groups-per-batch", "1",
            "--max-tokens", str(args.max_tokens), "--max-turns", str(args.max_turns),
            "--save-every", "0", "--log-path", str(run_dir), "--json",
        ]  # fmt: skip
        started = time.perf_counter()
        env = {**os.environ, "TINKER_API_KEY": "tml-dummy"}
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            sys.exit(result.stderr[-4000:])
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        containers = [json.loads(line) for line in (run_dir / "harbor_sandbox.jsonl").open()]
    rollouts = sum(r["env/all/total_episodes"] for r in rows)
    step_s = [r["time/total"] for r in rows]
    rollout_phase = [_total(r, "time/sampling") for r in rows]
    training = [_total(r, "time/train_step") for r in rows]
    start = sum(c["start_s"] + c.get("remove_s", 0.0) for c in containers)
    commands = sum(c["command_s"] for c in containers)
    sampling = sum(_total(r, "time/policy_sample") for r in rows)
    rollout_seconds = sum(
        _total(r, "time/do_group_rollout_and_filter_constant_reward") for r in rows
    )
    return {
        "rollouts": rollouts,
        "steps": len(rows),
        "rollouts_per_minute": 60 * rollouts / sum(step_s),
        "rollouts_per_minute_with_startup": 60 * rollouts / wall,
        "step_time_s": step_s,
        "step_split": {
            "rollout_phase": sum(rollout_phase) / sum(step_s),
            "training": sum(training) / sum(step_s),
            "other": 1 - (sum(rollout_phase) + sum(training)) / sum(step_s),
        },
        "rollout_seconds": rollout_seconds,
        "share_of_rollout_seconds": {
            "container_start_and_removal": start / rollout_seconds,
            "commands": commands / rollout_seconds,
            "policy_sampling": sampling / rollout_seconds,
            "other": 1 - (start + commands + sampling) / rollout_seconds,
        },
        "container_start_s": [c["start_s"] for c in containers],
        "container_remove_s": [c.get("remove_s") for c in containers],
        "commands_run": sum(c["commands"] for c in containers),
        "turns_per_episode": [r.get("env/all/turns_per_episode") for r in rows],
        "stop_max_tokens": [r.get("env/all/stop/max_tokens") for r in rows],
        "reward": [r.get("env/all/reward/total") for r in rows],
        "wall_s": wall,
    }


async def container_starts(n: int) -> dict:
    from rlcli.harbor import docker, tasks

    task = tasks.load_task(EXAMPLES / "write-file")
    factory = docker.DockerSandboxFactory([task], "bench-start")
    await factory.image_for(task)  # warm: built or found once
    starts, removes = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sandbox = await factory(task.environment, 600)
        t1 = time.perf_counter()
        await sandbox.run_command("true", timeout=10)  # it is up and answers
        t2 = time.perf_counter()
        await sandbox.cleanup()
        starts.append(t1 - t0)
        removes.append(time.perf_counter() - t2)
    return {
        "n": n,
        "start_s": _receipt.summary(starts),
        "remove_s": _receipt.summary(removes),
        "start_samples": starts,
        "under_1s": statistics.median(starts) < 1.0,
    }


async def verifier_runs() -> dict:
    from rlcli.harbor import docker, tasks, verifier

    out = {}
    found = tasks.load_tasks(EXAMPLES)
    factory = docker.DockerSandboxFactory(found, "bench-verify")
    for task in found:
        sandbox = await factory(task.environment, 600)
        try:
            t0 = time.perf_counter()
            await sandbox.run_command(task.solution.read_text(), workdir="/root", timeout=30)
            t1 = time.perf_counter()
            reward, _ = await verifier.verify(sandbox, task.tests, 30)
            t2 = time.perf_counter()
        finally:
            await sandbox.cleanup()
        out[task.name] = {"solution_s": t1 - t0, "verifier_s": t2 - t1, "reward": reward}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--starts", type=int, default=20)
    parser.add_argument("--name", default="harbor_rollouts")
    args = parser.parse_args()

    from rlcli.harbor import docker
    from rlcli.models.tiny import build_tiny_model

    version = docker.check_daemon()
    start = asyncio.run(container_starts(args.starts))
    verify = asyncio.run(verifier_runs())
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "m")
        trained = train(args, model, tmp)
    receipt = {
        "what": "train harbor rollouts/min and time shares; warm container start; verifier",
        "model": "rlcli tiny Qwen3, hidden 64, 2 layers",
        "docker": version,
        "config": vars(args),
        "train": trained,
        "container_start": start,
        "verifier": verify,
    }
    path = _receipt.write(args.name, receipt)
    shown = {
        "rollouts_per_minute": trained["rollouts_per_minute"],
        "step_split": trained["step_split"],
        "share_of_rollout_seconds": trained["share_of_rollout_seconds"],
        "container_start_median_s": start["start_s"]["median"],
        "container_remove_median_s": start["remove_s"]["median"],
    }
    print(json.dumps(shown, indent=1))
    print(f"-> {path}")


if __name__ == "__main__":
    main()

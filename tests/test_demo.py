"""``rlcli demo`` end to end in its smallest setting: the tiny model, a few SFT and RL steps,
through the CLI as a user runs it (real server process, unmodified tinker SDK)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import RLCLI, cli
from rlcli.demo.budget import RLBudget, verdict
from rlcli.demo.run import DemoConfig, reward, steps_for, style_rate
from rlcli.launch.pids import pid_alive


def test_demo_reports_before_after_writes_curves_and_stops_its_server(tmp_path, tiny_model):
    home = tmp_path / "home"
    run_dir = tmp_path / "run"
    args = ("demo", "--base-model", str(tiny_model), "--steps", "2", "--rl-steps", "2")
    result = cli(  # in this process; the Ctrl-C tests run it as a process
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
    assert summary["rl_verdict"]["rose"] is None  # 2 RL steps: too few to tell, and it says so
    assert summary["rl_verdict"]["says"].startswith("2 RL steps: too few to tell")
    listed = json.loads(cli("runs", "list", "--json", env={"RLCLI_HOME": str(home)}).stdout)
    assert [(r["run_dir"], r["kind"], r["status"], r["steps_done"]) for r in listed] == [
        (str(run_dir), "demo", "finished", 4)
    ]
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


@pytest.mark.parametrize("at, leaves_a_run", [("healthy after", False), ("sft 1/", True)])
def test_ctrl_c_leaves_no_empty_folder_and_a_started_run_is_listed(
    tmp_path, tiny_model, at, leaves_a_run
):
    """SIGINT once the server is up (nothing trained: no folder at all), or after the first
    SFT step (the folder records the steps and says interrupted; `runs list` shows it)."""
    home, run_dir = tmp_path / "home", tmp_path / "run"
    args = ("demo", "--base-model", str(tiny_model), "--steps", "50", "--rl-steps", "2")
    err = tmp_path / "stderr.txt"
    env = {**os.environ, "RLCLI_HOME": str(home)}
    with err.open("w") as out:
        proc = subprocess.Popen(
            [*RLCLI, *args, "--log-path", str(run_dir)], stderr=out, stdout=subprocess.DEVNULL,
            env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while at not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, err.read_text()[-3000:]
    assert "server stopped" in err.read_text()
    assert not (home / "demo" / "server.json").exists()
    listed = json.loads(cli("runs", "list", "--json", env={"RLCLI_HOME": str(home)}).stdout)
    if not leaves_a_run:
        assert not run_dir.exists() and listed == []
        return
    record = json.loads((run_dir / "rlcli_run.json").read_text())
    assert (record["status"], record["kind"]) == ("interrupted", "demo")
    assert [(r["id"], r["status"]) for r in listed] == [("run", "interrupted")]
    assert listed[0]["steps_done"] >= 1 and listed[0]["last_metric"] == "SFT loss"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_rl_phase_is_sized_to_the_machine_on_a_fake_clock():
    clock = FakeClock()

    def budget_after_sft(sft_step_s: float, sft_steps: int = 16) -> tuple[RLBudget, str]:
        clock.now = 40 + sft_steps * sft_step_s  # the server, the first answers, then SFT
        budget = RLBudget.for_budget(24, 0.0, 10, reserve_s=20, clock=clock)
        return budget, budget.plan(sft_step_s)

    # A quiet machine (SFT 4 s a step): 24 RL steps of ~14 s fit in the 10 minutes.
    budget, said = budget_after_sft(4.0)
    assert (budget.planned, budget.stretched) == (24, False)
    assert said.startswith("RL: 24 steps, about 5.6 min at this machine's speed")

    # A busy one (9 s): the steps do not fit, so the budget stretches, and says by how much.
    budget, said = budget_after_sft(9.0)
    assert (budget.planned, budget.stretched) == (24, True)
    assert "the reward needs them all to show a rise, so the demo runs about 6.0 min" in said
    steps = 0
    while budget.keep_going(steps):
        clock.now += 31.5
        budget.took(31.5)
        steps += 1
    assert steps == 24

    # Too slow even for 3x the budget (30 s): what fits, and the --minutes that would do.
    budget, said = budget_after_sft(30.0)
    assert budget.planned == 12 and budget.stretched
    assert said.startswith("RL: this machine is too slow for 24 steps even at 3x --minutes")
    assert said.endswith("(more time: --minutes 51)")

    # Steps slower than SFT predicted: past --minutes it says so once, and stops at 3x.
    budget, _ = budget_after_sft(4.0)
    taken, lines = 0, []
    while budget.keep_going(taken):
        lines.append(budget.overrun())
        clock.now += 100.0
        budget.took(100.0)
        taken += 1
    assert [x for x in lines if x] == [
        "RL: past --minutes; finishing the planned steps (the reward needs them)"
    ]
    assert taken == 16 and clock.now <= budget.hard


def test_the_verdict_says_whether_the_reward_rose():
    quiet = [0.47, 0.49, 0.5, 0.46, 0.57, 0.35, 0.63, 0.65, 0.49, 0.56, 0.57, 0.61,
             0.59, 0.6, 0.65, 0.67, 0.77, 0.76, 0.74, 0.64, 0.71, 0.8, 0.92, 0.79]  # fmt: skip
    rose = verdict(quiet)
    assert rose["rose"] is True and rose["says"].startswith("rose 0.52 -> 0.77 (mean of the")
    busy = [0.57, 0.5, 0.45, 0.52, 0.41, 0.40]  # the 6 steps on a busy machine
    fell = verdict(busy)
    assert fell["rose"] is False and fell["says"].startswith("did not rise: 0.53 -> 0.41")
    assert "not a result" in fell["says"]
    assert verdict([0.2, 0.9])["rose"] is None


def test_demo_loop_captures_judges_learns_gates_and_refuses_the_shuffled_round(
    tmp_path, tiny_model
):
    """``demo --loop`` in its smallest setting: questions asked of the alias through /v1 and
    captured, the judge's verdicts posted to /v1/feedback, one learn round through the gate,
    the shuffled round refused; the receipt, the plot and the run record. The tiny model
    learns no sums, and the summary says so."""
    from rlcli import trace_format
    from rlcli.demo.loop import JUDGE, summary_lines

    home, run_dir = tmp_path / "home", tmp_path / "run"
    env = {"RLCLI_HOME": str(home)}
    result = cli(
        "demo", "--loop", "--base-model", str(tiny_model), "--rounds", "1", "--questions", "8",
        "--epochs", "1", "--log-path", str(run_dir), "--json", env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    first, shuffled = out["rounds"]
    assert (first["shuffled_verdicts"], shuffled["shuffled_verdicts"]) == (False, True)
    assert first["traces"]["new"] == shuffled["traces"]["new"] == 8
    assert shuffled["traces"]["already_used"] == 8  # round 1's traces are not trained twice
    assert first["decision"] in ("promoted", "refused") and first["why"]
    assert shuffled["decision"] == "refused" and out["verdict"]["shuffled_refused"]
    # (held out by a hash of random trace ids: 8 questions may hold out none, and it says so)
    assert out["verdict"]["gate_says"] == f"shuffled round refused: {shuffled['why']}"
    # the traces came through /v1 into the capture folder, each with the judge's verdict
    capture = Path(out["capture"])
    verdicts = list(trace_format.read(capture, trace_format.FEEDBACK))
    assert len(verdicts) == 16 and {v["source"] for v in verdicts} == {JUDGE}
    traced = {t["id"] for t in trace_format.read(capture, trace_format.TRACES)}
    assert {v["run_id"] for v in verdicts} <= traced
    learn_dir = Path(out["learn_dir"])
    assert [json.loads((learn_dir / n / "receipt.json").read_text())["decision"]
            for n in ("001", "002")] == [first["decision"], "refused"]  # fmt: skip
    # the tiny model learns no sums: said plainly, not drawn as a success
    assert not out["verdict"]["learned"] and out["verdict"]["says"].startswith("did not learn")
    assert json.loads((run_dir / "receipt.json").read_text())["verdict"] == out["verdict"]
    assert Path(out["plot"]) == run_dir / "scores.png"
    assert (run_dir / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    screen = summary_lines(out)
    assert out["verdict"]["says"] in screen and screen[-1] == f"receipt: {run_dir / 'receipt.json'}"
    listed = json.loads(cli("runs", "list", "--json", env=env).stdout)
    mine = [r for r in listed if r["run_dir"] == str(run_dir)]
    assert [(r["kind"], r["status"], r["steps_done"], r["last_metric"]) for r in mine] == [
        ("demo", "finished", 2, "held-out score")
    ]
    assert "server stopped" in result.stderr and not (home / "demo" / "server.json").exists()


def test_demo_loop_refuses_the_sft_rl_demos_step_flags(tmp_path):
    result = cli("demo", "--loop", "--steps", "2", env={"RLCLI_HOME": str(tmp_path)})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: demo --loop: --steps size the SFT/RL demo; the loop's work is --rounds, "
        "--questions and --epochs"
    ]


def test_demo_loop_ctrl_c_before_a_round_ends_leaves_no_folder(tmp_path, tiny_model):
    """SIGINT while the first round's verdicts are posted: the server stopped, no run folder,
    no learn folder, nothing for `runs list`."""
    home, run_dir = tmp_path / "home", tmp_path / "run"
    err = tmp_path / "stderr.txt"
    args = ("demo", "--loop", "--base-model", str(tiny_model), "--questions", "8")
    with err.open("w") as out:
        proc = subprocess.Popen(
            [*RLCLI, *args, "--log-path", str(run_dir)], stderr=out, stdout=subprocess.DEVNULL,
            env={**os.environ, "RLCLI_HOME": str(home)},
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while "round 1: the judge posts" not in err.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, err.read_text()[-3000:]
    assert "server stopped" in err.read_text()
    assert not (home / "demo" / "server.json").exists()
    assert not run_dir.exists() and not list((home / "learn").glob("*"))
    assert json.loads(cli("runs", "list", "--json", env={"RLCLI_HOME": str(home)}).stdout) == []

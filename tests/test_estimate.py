"""``train --dry-run``'s wall-time estimate and ``--max-minutes``: the estimate of a tiny-model
run is within 2x of the run's own time (the issue's bar), says whether it came from a
calibration or an earlier run's rates, and says why when there is none; a run stopped at
``--max-minutes`` leaves a checkpoint its resume command continues to the end."""

from __future__ import annotations

import json
import shlex
import time
from importlib.resources import files

import pytest

from conftest import cli
from rlcli.runs import timing

DEAD_URL = "http://127.0.0.1:9"


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "style.jsonl"
    path.write_text(files("rlcli.data").joinpath("demo_style.jsonl").read_text())
    return path  # 48 conversations


def sl_args(server, tiny_model, chats, run_dir, *extra, batch_size=4):
    return (
        "train", "sl", "--model", str(tiny_model), "--dataset", str(chats),
        "--base-url", server.base_url, "--batch-size", str(batch_size), "--epochs", "2",
        "--log-path", str(run_dir), *extra,
    )  # fmt: skip


def test_the_estimate_is_within_2x_of_the_run_and_names_its_source(
    tmp_path, server, tiny_model, chats
):
    run_dir = tmp_path / "run"
    dry = cli(*sl_args(server, tiny_model, chats, run_dir, "--dry-run", "--json"))
    assert dry.returncode == 0, dry.stderr
    calibrated = json.loads(dry.stdout)["estimate"]
    assert calibrated["from"].startswith("a 3-step calibration on " + server.base_url)
    assert calibrated["low"] <= calibrated["seconds"] <= calibrated["high"]
    assert not run_dir.exists()  # the calibration ran in a scratch folder, now gone

    t0 = time.monotonic()
    real = cli(*sl_args(server, tiny_model, chats, run_dir, "--json"))
    took = time.monotonic() - t0
    assert real.returncode == 0, real.stderr[-3000:]
    assert took / 2 <= calibrated["seconds"] <= took * 2, (calibrated, took)

    # The same settings again (another learning rate does not change a step's time): the
    # finished run's measured rates, at no cost.
    next_run = tmp_path / "next"
    args = sl_args(server, tiny_model, chats, next_run, "--dry-run", "--json", "--lr", "1e-3")
    again = cli(*args)
    measured = json.loads(again.stdout)["estimate"]
    assert measured["from"].startswith("the measured rates of run run (load "), measured
    assert took / 2 <= measured["seconds"] <= took * 2, (measured, took)
    text = cli(*sl_args(server, tiny_model, chats, next_run, "--dry-run"))
    assert "wall time    about " in text.stdout and "from         the measured rates" in text.stdout


def test_an_rl_dry_run_calibrates_its_rollouts_too(tmp_path, server, tiny_model):
    # A home of its own: another file's RL run of these settings would give its rates instead
    home = {"RLCLI_HOME": str(tmp_path / "home")}
    result = cli(
        "train", "rl", "--model", str(tiny_model), "--base-url", server.base_url,
        "--dataset", "arithmetic", "--batch-size", "2", "--group-size", "2", "--max-tokens",
        "6", "--max-steps", "8", "--log-path", str(tmp_path / "rl"), "--dry-run", "--json",
        "--max-minutes", "0.001", env=home,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    estimate = json.loads(result.stdout)["estimate"]
    assert estimate["from"].startswith("a 3-step calibration") and estimate["seconds"] > 0
    assert estimate["low"] < estimate["seconds"] < estimate["high"]
    assert "answers' length" in estimate["note"]
    assert estimate["max_minutes"].startswith("--max-minutes 0.001 stops it after about 1 of 8")


def test_without_a_server_the_estimate_says_why_and_no_estimate_skips_it(tmp_path, tiny_model):
    args = ("train", "dpo", "--model", str(tiny_model), "--base-url", DEAD_URL, "--json")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Hi", "chosen": "Hello!", "rejected": "Go."}) + "\n")
    result = cli(*args, "--dataset", str(pairs), "--batch-size", "1", "--dry-run")
    assert result.returncode == 0, result.stderr
    estimate = json.loads(result.stdout)["estimate"]
    assert estimate["seconds"] is None
    assert estimate["why"].startswith(f"no earlier run of these settings and no Tinker server "
                                      f"answered at {DEAD_URL}")  # fmt: skip
    plain = cli(*args, "--dataset", str(pairs), "--batch-size", "1", "--dry-run", "--no-estimate")
    assert "estimate" not in json.loads(plain.stdout)


def test_max_minutes_stops_with_a_checkpoint_that_the_resume_continues(
    tmp_path, server, tiny_model, chats
):
    run_dir = tmp_path / "run"
    # Other settings than the first test's (whose estimate must not find this run's rates)
    args = sl_args(server, tiny_model, chats, run_dir, "--json", batch_size=6)
    stopped = cli(*args, "--max-minutes", "0.001")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    summary = json.loads(stopped.stdout)
    assert summary["stopped"] == "stopped at --max-minutes 0.001 after step 1 of 16"
    assert summary["state_path"].endswith("/weights/000001")
    record = json.loads((run_dir / "rlcli_run.json").read_text())
    assert (record["status"], record["exit_code"]) == ("stopped", 0)
    listed = json.loads(cli("runs", "list", "--json", env={}).stdout)
    assert any(r["run_dir"] == str(run_dir) and r["status"] == "stopped" for r in listed)

    resumed = cli(*shlex.split(summary["resume"])[1:], "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming in" in resumed.stderr
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(16))
    assert json.loads((run_dir / "rlcli_run.json").read_text())["status"] == "finished"


def test_the_step_clock_and_its_prediction_on_a_fake_clock():
    clock = timing.StepClock()
    clock.start = 100.0
    clock.steps_arrived(1, now=110.0)  # start-up and the first step: 10 s
    clock.steps_arrived(2, now=112.0)  # two steps in one poll: 1 s each
    clock.steps_arrived(1, now=115.0)  # a slow one: 3 s
    clock.end(now=119.0)  # the final save: 4 s
    measured = clock.summary()
    assert measured["startup_s"] == 10.0 and measured["finish_s"] == 4.0
    assert measured["step_s"] == {"mean": 1.6667, "median": 1.0, "min": 1.0, "max": 3.0, "n": 3}
    measured["step_s"]["mean"] = 2.0
    # 11 steps, a save every 5 (after steps 5 and 10) and the final one; 2 s of checks first
    got = timing.predict(measured, steps=11, save_every=5, prepare_s=2.0)
    fixed = 2.0 + 10.0 + 3 * 4.0
    assert got["seconds"] == fixed + 10 * 2.0 and got["saves"] == 3
    assert got["low"] == 0.75 * fixed + 10 * 1.0 and got["high"] == 1.25 * fixed + 10 * 3.0
    # A short run's steps all arrive in one look: the first ends the start-up, the others
    # share the time since the look before (not "no interval": a step of half the start-up)
    burst = timing.StepClock()
    burst.start = 100.0
    burst.steps_arrived(0, now=104.75)
    burst.steps_arrived(3, now=105.0)
    assert burst.summary()["startup_s"] == 5.0
    assert burst.summary()["step_s"]["mean"] == round(0.25 / 3, 4)
    assert timing.human(59) == "59 s" and timing.human(125) == "2 min 05 s"

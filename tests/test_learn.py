"""``rlcli learn`` on the shared tiny-model server: a round trained on corrections is promoted
(held-out 0 -> 100: every door's password is "zebra"), a round on shuffled corrections is
refused by the gate with the alias unchanged; the receipt, history, status and plot; a dry run
writes nothing; an rl round (``train rl`` on the logged prompts, graded by exact match or a
``--reward``) trains and the gate decides; too few traces, ``--method rl`` with nothing to grade
by and a concurrent round are one line; kill -9 mid-training and after evaluation, then a
rerun: no second training, the alias moved once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli


def traces(path: Path, doors: range, answer, prefix: str) -> Path:
    """Judged traces as ``rlcli import -f langsmith`` writes them: a wrong answer, a score of
    0 and a correction."""
    rows = []
    for i in doors:
        rows.append({
            "messages": [{"role": "user", "content": f"What is the password for door {i}?"},
                         {"role": "assistant", "content": "I do not know."}],
            "feedback": [{"key": "correct", "score": 0, "value": None, "comment": None,
                          "correction": {"outputs": {"content": answer(i)}}, "source": "app"}],
            "origin": {"format": "langsmith", "trace_id": f"{prefix}-{i}", "call_id": "c"},
        })  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


FAST = ["--lr", "5e-3", "--epochs", "2", "--max-tokens", "8"]


def learn(home: Path, server, *args):
    env = {"RLCLI_HOME": str(home)}
    return cli("learn", *args, "--base-url", server.base_url, *FAST, env=env)


def alias_history(server, name: str) -> dict:
    out = cli("alias", "history", name, "--base-url", server.base_url, "--json")
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def capturing(tmp_path_factory, tiny_model):
    """A tiny-model server of this module's own, capturing every /v1 exchange."""
    from conftest import start_server
    from rlcli.launch import process

    home = tmp_path_factory.mktemp("capture-home")
    record = start_server(home, tiny_model, capture=str(home / "traces"))
    yield record, home / "traces"
    process.stop(home)


def asked_and_judged(record, alias: str, doors: range, folder: Path) -> set[str]:
    """Each door's question asked of the alias through /v1 (captured), then a verdict through
    POST /v1/feedback: score 0 and the correction "zebra"; the trace ids, once on disk."""
    import httpx
    import openai

    from rlcli import trace_format

    ai = openai.OpenAI(base_url=f"{record.base_url}/v1", api_key="tml-dummy", max_retries=0)
    ids = set()
    for i in doors:
        raw = ai.chat.completions.with_raw_response.create(
            model=alias, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": f"What is the password for door {i}?"}],
        )  # fmt: skip
        trace_id = raw.headers["x-rlcli-trace-id"]
        verdict = {"run_id": trace_id, "key": "correct", "score": 0, "correction": "zebra"}
        assert httpx.post(f"{record.base_url}/v1/feedback", json=verdict).status_code == 200
        ids.add(trace_id)
    deadline = time.monotonic() + 60  # the capture's writer thread appends soon after
    while not ids <= {r["id"] for r in trace_format.read(folder, trace_format.TRACES)}:
        assert time.monotonic() < deadline, "the captured traces were not written"
        time.sleep(0.2)
    return ids


def test_a_round_is_promoted_and_a_shuffled_round_refused(tmp_path, capturing, tiny_model):
    """The loop through the server: each question asked of the alias at /v1 and captured, a
    verdict posted to /v1/feedback, then ``learn --traces CAPTURE_FOLDER``."""
    server, first = capturing
    home = tmp_path / "home"
    url = ["--base-url", server.base_url]
    assert cli("alias", "set", "doors", str(tiny_model), *url).returncode == 0
    asked_and_judged(server, "doors", range(24), first)
    plan = learn(home, server, "--alias", "doors", "--traces", first, "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    assert planned["traces"]["new"] == 24 and planned["method"] == "sl"
    assert planned["traces"]["train"] + planned["traces"]["held_out"] == 24
    assert not (home / "learn" / "doors" / "001").exists()  # a dry run writes nothing
    pairs = learn(home, server, "--alias", "doors", "--traces", first, "--method", "dpo",
                  "--dry-run", "--json")  # fmt: skip
    assert json.loads(pairs.stdout)["method"] == "dpo"  # a correction against the answer
    assert json.loads(pairs.stdout)["traces"]["trained_on"] == planned["traces"]["train"]

    # Batches of 4: the held-out share is drawn by a hash of random trace ids, and 10 of 24
    # held out left 2 steps of 8 (CI refused a round that 4 steps promote)
    done = learn(home, server, "--alias", "doors", "--traces", first, "--batch-size", "4", "--json")
    assert done.returncode == 0, done.stderr
    receipt = json.loads(done.stdout)
    assert receipt["decision"] == "promoted", receipt["why"]
    held = receipt["scores"]["held_out"]
    assert held["current"]["mean"] == 0.0 and held["candidate"]["mean"] == 1.0
    assert held["current"]["n"] == planned["traces"]["held_out"]
    assert set(receipt["seconds"]) == {"data", "train", "eval", "promote"}
    saved = json.loads((home / "learn" / "doors" / "001" / "receipt.json").read_text())
    assert saved == receipt
    log = alias_history(server, "doors")["log"]
    assert log[-1]["checkpoint"] == receipt["candidate"]["checkpoint"]
    assert log[-1]["why"].startswith("learn round 1: held-out 0.0 -> 100.0")
    assert (home / "learn" / "doors" / "scores.png").stat().st_size > 0

    again = learn(home, server, "--alias", "doors", "--traces", first)
    assert again.returncode == 1 and "0 judged traces not used before" in again.stderr

    rng = random.Random(0)
    words = ["apple", "river", "stone", "cloud", "maple", "tiger", "piano", "ocean"]
    shuffled = traces(tmp_path / "week2.jsonl", range(100, 124), lambda i: rng.choice(words), "w2")
    refused = learn(home, server, "--alias", "doors", "--traces", first, "--traces", shuffled,
                    "--json")  # fmt: skip
    assert refused.returncode == 0, refused.stderr
    second = json.loads(refused.stdout)
    assert second["decision"] == "refused" and second["traces"]["already_used"] == 24
    assert (
        alias_history(server, "doors")["log"][-1]["checkpoint"]
        == receipt["candidate"]["checkpoint"]
    )  # unchanged
    rounds = json.loads(cli("learn", "history", "--alias", "doors", "--json",
                            env={"RLCLI_HOME": str(home)}).stdout)  # fmt: skip
    assert [r["decision"] for r in rounds] == ["promoted", "refused"]
    status = json.loads(cli("learn", "status", "--alias", "doors", "--json",
                            env={"RLCLI_HOME": str(home)}).stdout)  # fmt: skip
    assert status["rounds"] == 2 and status["last_stage"] == "done"


def scored(path: Path, doors: range, prefix: str) -> Path:
    """Judged traces with a score of 0 and no correction: no right answer to match."""
    rows = [{
        "messages": [{"role": "user", "content": f"What is the password for door {i}?"},
                     {"role": "assistant", "content": "I do not know."}],
        "feedback": [{"key": "correct", "score": 0}],
        "origin": {"format": "langsmith", "trace_id": f"{prefix}-{i}", "call_id": "c"},
    } for i in doors]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


RL = ["--group-size", "2"]  # and FAST's --epochs 2: each prompt twice


def test_an_rl_round_trains_and_the_gate_decides(tmp_path, server, tiny_model):
    """``--method rl``: ``train rl`` on the round's prompts from the alias's state, each
    rollout graded by exact match to the correction; scores alone and a ``--reward``: auto
    picks rl, the reward grades both the rollouts and the gate."""
    home = tmp_path / "home"
    url = ["--base-url", server.base_url]
    assert cli("alias", "set", "rlq", str(tiny_model), *url).returncode == 0
    data = traces(tmp_path / "t.jsonl", range(16), lambda i: "zebra", "rl")
    plan = json.loads(learn(home, server, "--alias", "rlq", "--traces", data, "--method", "rl",
                            *RL, "--dry-run", "--json").stdout)  # fmt: skip
    assert plan["method"] == "rl" and plan["traces"]["trained_on"] == 2 * plan["traces"]["train"]
    done = learn(home, server, "--alias", "rlq", "--traces", data, "--method", "rl", *RL, "--json")
    assert done.returncode == 0, done.stderr
    receipt = json.loads(done.stdout)
    assert receipt["method"] == "rl" and receipt["decision"] in ("promoted", "refused")
    assert receipt["train"]["loss"] == "importance_sampling" and "final_reward" in receipt["train"]
    assert receipt["candidate"]["checkpoint"].startswith("tinker://")
    assert receipt["scores"]["held_out"]["current"]["n"] == plan["traces"]["held_out"]
    run = json.loads((home / "learn" / "rlq" / "001" / "run" / "rlcli_spec.json").read_text())
    assert run["options"]["init_checkpoint"] is None  # the alias served the base model
    log = alias_history(server, "rlq")["log"]
    promoted = receipt["decision"] == "promoted"
    assert len(log) == 1 + promoted
    assert (log[-1]["checkpoint"] == receipt["candidate"]["checkpoint"]) == promoted

    reward = tmp_path / "reward.py"
    reward.write_text("def reward(question, answer, reference=None):\n"
                      "    return float('zebra' in answer.lower())\n")  # fmt: skip
    judged = scored(tmp_path / "s.jsonl", range(16), "sc")
    auto = learn(home, server, "--alias", "rlq", "--traces", judged, "--reward", f"{reward}:reward",
                 *RL, "--dry-run", "--json")  # fmt: skip
    assert auto.returncode == 0, auto.stderr
    picked = json.loads(auto.stdout)  # scores, no right answer, a reward: rl on every prompt
    assert (
        picked["method"] == "rl" and picked["traces"]["trained_on"] == 2 * picked["traces"]["train"]
    )
    graded = learn(home, server, "--alias", "rlq", "--traces", judged, "--reward",
                   f"{reward}:reward", *RL, "--json")  # fmt: skip
    assert graded.returncode == 0, graded.stderr
    second = json.loads(graded.stdout)
    assert second["method"] == "rl" and second["round"] == 2
    held = second["scores"]["held_out"]["current"]["n"]  # the reward scores every held-out trace
    assert held == plan["traces"]["held_out"] + picked["traces"]["held_out"]
    run = json.loads((home / "learn" / "rlq" / "002" / "run" / "rlcli_spec.json").read_text())
    start = receipt["candidate"]["state"] if promoted else None  # the alias's training state
    assert run["options"]["init_checkpoint"] == start and run["options"]["reward"]
    promoted_too = second["decision"] == "promoted"
    assert len(alias_history(server, "rlq")["log"]) == 1 + promoted + promoted_too


def test_refusals_are_one_line(tmp_path, server, tiny_model, monkeypatch):
    from rlcli.learn.round import locked

    home = tmp_path / "home"
    cli("alias", "set", "few", str(tiny_model), "--base-url", server.base_url)
    few = traces(tmp_path / "few.jsonl", range(3), lambda i: "zebra", "few")
    cases = [
        (("--alias", "few", "--traces", few), "needs at least 8 (--min-traces)"),
        (("--alias", "nobody", "--traces", few), "not an alias on"),
        (("--alias", "few", "--traces", tmp_path / "missing.jsonl"), "no such file"),
        (("--alias", "few", "--traces", scored(tmp_path / "s.jsonl", range(3), "s"),
          "--min-traces", "2", "--method", "rl"), "no trace with a right answer"),
    ]  # fmt: skip
    for args, expected in cases:
        result = learn(home, server, *args)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, (args, result.stderr)
        assert expected in result.stderr, (args, result.stderr)
    monkeypatch.setenv("RLCLI_HOME", str(home))
    with locked("few"):  # another round holds the alias
        busy = learn(home, server, "--alias", "few", "--traces", few, "--min-traces", "2")
    assert busy.returncode == 1 and "a round is already running on this alias" in busy.stderr
    assert not list((home / "learn" / "few").glob("0*"))


def _learn_process(home: Path, server, data: Path, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "rlcli.cli.main", "learn", "--alias", "crash", "--traces",
            str(data), "--base-url", server.base_url, *FAST, "--json"]  # fmt: skip
    env = {**os.environ, "RLCLI_HOME": str(home)}
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "learn ended before the point it was to be killed at"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_kill_9_mid_training_and_after_evaluation_then_rerun(tmp_path, server, tiny_model):
    from rlcli.runs.runner import metric_values

    home = tmp_path / "home"
    cli("alias", "set", "crash", str(tiny_model), "--base-url", server.base_url)
    data = traces(tmp_path / "t.jsonl", range(24), lambda i: "zebra", "k")
    folder = home / "learn" / "crash" / "001"

    def trained_a_step() -> bool:
        metrics = folder / "run" / "metrics.jsonl"
        return metrics.exists() and metrics.read_text().count("\n") >= 1

    _kill_when(_learn_process(home, server, data, tmp_path / "1.log"), trained_a_step)
    for child in _recipe_children(folder / "run"):  # the recipe child dies with its parent
        _wait_gone(child)
    assert not (folder / "trained.json").exists()
    _kill_when(_learn_process(home, server, data, tmp_path / "2.log"),
               lambda: (folder / "evaluated.json").exists())  # fmt: skip
    assert not (folder / "receipt.json").exists()
    assert len(alias_history(server, "crash")["log"]) == 1  # not promoted before the gate
    last = _learn_process(home, server, data, tmp_path / "3.log")
    assert last.wait(300) == 0, (tmp_path / "3.log").read_text()[-2000:]
    receipt = json.loads((folder / "receipt.json").read_text())
    assert receipt["decision"] == "promoted"
    steps = metric_values(folder / "run", "train_mean_nll")["train_mean_nll"]
    plan = json.loads((folder / "plan.json").read_text())
    expected = 2 * (plan["traces"]["trained_on"] // min(8, plan["traces"]["trained_on"]))
    assert len(steps) == expected  # each step once, across the kill and the resume
    log = alias_history(server, "crash")["log"]
    assert [e["why"].split(":")[0] for e in log[1:]] == ["learn round 1"]  # one switch
    assert len(list((home / "learn" / "crash").glob("0*"))) == 1  # no second round


def _recipe_children(run_dir: Path) -> list[int]:
    from conftest import recipe_children

    return recipe_children(run_dir)


def _wait_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


@pytest.mark.slow
def test_smollm2_learns_the_answer_format_from_corrections(tmp_path, smollm2_model):
    """SmolLM2-135M-Instruct answers "What is A + B? Reply with the number only." with
    "A + B = C" (0 exact matches); one round on 40 corrections (the sum alone) is promoted and
    the held-out score rises by at least 20 points."""
    from conftest import start_server
    from rlcli.launch import process

    rng = random.Random(0)
    pairs = [(rng.randint(10, 49), rng.randint(10, 49)) for _ in range(40)]
    rows = [{
        "messages": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."},
                     {"role": "assistant", "content": f"{a} + {b} = {a + b}"}],
        "feedback": [{"key": "correct", "score": 0, "correction": str(a + b)}],
        "origin": {"format": "langsmith", "trace_id": f"sum-{i}", "call_id": "c"},
    } for i, (a, b) in enumerate(pairs)]  # fmt: skip
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server_home = tmp_path / "server"
    record = start_server(server_home, smollm2_model)
    try:
        url = ["--base-url", record.base_url]
        assert cli("alias", "set", "sums", str(smollm2_model), *url).returncode == 0
        env = {"RLCLI_HOME": str(tmp_path / "home")}
        out = cli("learn", "--alias", "sums", "--traces", data, "--lr", "1e-3", "--epochs", "3",
                  "--max-tokens", "12", "--json", *url, env=env)  # fmt: skip
        assert out.returncode == 0, out.stderr
        receipt = json.loads(out.stdout)
        held = receipt["scores"]["held_out"]
        assert receipt["decision"] == "promoted", receipt["why"]
        assert held["candidate"]["mean"] - held["current"]["mean"] >= 0.2, held
    finally:
        process.stop(server_home)

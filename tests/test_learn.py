"""``rlcli learn`` on the shared tiny-model server: a round trained on corrections is promoted
(held-out 0 -> 100: every door's password is "zebra"), a round on shuffled corrections is
refused by the gate with the alias unchanged; the receipt, history, status and plot; a dry run
writes nothing; an rl round (``train rl`` on the logged prompts, graded by exact match or a
``--reward``) trains and the gate decides; too few traces, ``--method rl`` with nothing to grade
by and a concurrent round are one line; kill -9 mid-training and after evaluation, then a
rerun: no second training, the alias moved once."""

from __future__ import annotations

import dataclasses
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


def test_the_held_out_share_is_a_fixed_count_chosen_by_id_hash():
    """round(share * n) held out, at least one of two or more, none of one; the same traces
    split the same way in any order (a coin per trace once held out 0 of 24 at 0.25)."""
    from rlcli.learn.traces import Trace, split

    def made(n: int) -> list[Trace]:
        return [Trace(f"chatcmpl-{i:04x}", [], "a", "b", False) for i in range(n)]

    for n, share, held in ((24, 0.25, 6), (10, 0.25, 2), (2, 0.1, 1), (1, 0.5, 0), (8, 0.0, 0)):
        train, out = split(made(n), share)
        assert (len(train), len(out)) == (n - held, held), (n, share)
    forward, backward = split(made(24), 0.25), split(made(24)[::-1], 0.25)
    assert {t.id for t in forward[1]} == {t.id for t in backward[1]}


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
    the held-out score rises by at least 20 points. Single digits: the model adds them right
    (12 of 16 within its "A + B = C"), so the score measures the format it learned, not its
    arithmetic (two-digit sums held it at the bar: 2 of 8 after 3 epochs). Two epochs: these
    held-out 0 -> 8 of 8, and +50 to +73 points on three other sets (2026-12-04)."""
    from conftest import start_server
    from rlcli.launch import process

    rng = random.Random(0)
    pairs = [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(40)]
    rows = [{
        "messages": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."},
                     {"role": "assistant", "content": f"{a} + {b} = {a + b}"}],
        "feedback": [{"key": "correct", "score": 0, "correction": str(a + b)}],
        "origin": {"format": "langsmith", "trace_id": f"sum-{i}", "call_id": "c"},
    } for i, (a, b) in enumerate(pairs)]  # fmt: skip
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server_home = tmp_path / "server"
    record = start_server(server_home, smollm2_model, dtype="auto")  # bf16 here, as users get it
    try:
        url = ["--base-url", record.base_url]
        assert cli("alias", "set", "sums", str(smollm2_model), *url).returncode == 0
        env = {"RLCLI_HOME": str(tmp_path / "home")}
        out = cli("learn", "--alias", "sums", "--traces", data, "--lr", "1e-3", "--epochs", "2",
                  "--max-tokens", "8", "--json", *url, env=env)  # fmt: skip
        assert out.returncode == 0, out.stderr
        receipt = json.loads(out.stdout)
        held = receipt["scores"]["held_out"]
        assert receipt["decision"] == "promoted", receipt["why"]
        assert held["candidate"]["mean"] - held["current"]["mean"] >= 0.2, held
    finally:
        process.stop(server_home)


# ---- --judge: the gate scored pairwise by a judge model ----------------------------------


class SumsJudge:
    """A scripted judge behind a small OpenAI-compatible HTTP server started by the test: a
    stand-in for "any OpenAI-compatible server" (``--judge-base-url``). Of the two answers in
    learn's prompt it names the one equal to the question's sum (``What is X + Y?``), and
    neither (an unreadable verdict: a tie) when both or none are; model ``broken`` answers
    500, ``silent`` only after 3 s, any other model 404, as OpenAI does."""

    MODEL = "sums-judge"

    def __init__(self):
        import re
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from rlcli.learn.judge import PROMPT

        pattern = re.escape(PROMPT).replace(r"\{question\}", "(.*)").replace(r"\{a\}", "(.*)")
        shape = re.compile(pattern.replace(r"\{b\}", "(.*)"), re.DOTALL)
        asked = self.asked = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(200, {"object": "list", "data": [
                    {"id": SumsJudge.MODEL, "object": "model", "owned_by": "test"}]})  # fmt: skip

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if body["model"] == "silent":  # past the check's timeout (the test sets 1 s)
                    time.sleep(3)
                    return self.reply(500, {"error": {"message": "too late"}})
                if body["model"] == "broken":
                    return self.reply(500, {"error": {"message": "the judge fell over"}})
                if body["model"] != SumsJudge.MODEL:
                    return self.reply(404, {"error": {"message": "no such model",
                                                      "code": "model_not_found"}})  # fmt: skip
                question, a, b = shape.fullmatch(body["messages"][-1]["content"]).groups()
                asked.append((question, a, b))
                x, y = map(int, re.search(r"(\d+) \+ (\d+)", question).groups())
                right = [s.strip().rstrip(".") == str(x + y) for s in (a, b)]
                verdict = {(True, False): "A", (False, True): "B"}.get(tuple(right), "either")
                choice = {"index": 0, "message": {"role": "assistant", "content": verdict},
                          "finish_reason": "stop"}  # fmt: skip
                self.reply(200, {"id": "j", "object": "chat.completion", "created": 0,
                                 "model": SumsJudge.MODEL, "choices": [choice]})  # fmt: skip

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def sums_judge():
    judge = SumsJudge()
    yield judge
    judge.http.shutdown()


def sums(path: Path, numbers: range, answer, prefix: str) -> Path:
    """Judged traces of "What is i + (10 - i)?" (every sum 10, so the tiny model can learn it
    in a round): a wrong answer, a score of 0 and ``answer(i)`` as the correction."""
    rows = [{
        "messages": [{"role": "user", "content": f"What is {i % 10} + {10 - i % 10}?"},
                     {"role": "assistant", "content": "I do not know."}],
        "feedback": [{"key": "correct", "score": 0, "correction": answer(i)}],
        "origin": {"format": "langsmith", "trace_id": f"{prefix}-{i}", "call_id": "c"},
    } for i in numbers]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_judge_gates_the_round_pairwise(tmp_path, server, tiny_model, sums_judge):
    """``--judge`` on another OpenAI-compatible server: a round that taught the sum wins every
    pair (promoted), a round on a wrong sum (11) loses them (refused, the alias unchanged);
    each question asked in both orders; the verdicts in the receipt."""
    home = tmp_path / "home"
    assert (
        cli("alias", "set", "sums", str(tiny_model), "--base-url", server.base_url).returncode == 0
    )
    judged = ["--alias", "sums", "--judge", SumsJudge.MODEL, "--judge-base-url", sums_judge.url,
              "--batch-size", "4", "--json"]  # fmt: skip
    data = sums(tmp_path / "right.jsonl", range(24), lambda i: "10", "right")
    plan = json.loads(learn(home, server, *judged, "--traces", data, "--dry-run").stdout)
    assert plan["judge"] == {"model": SumsJudge.MODEL, "base_url": sums_judge.url,
                             "prompt": plan["judge"]["prompt"]}  # fmt: skip
    done = learn(home, server, *judged, "--traces", data)
    assert done.returncode == 0, done.stderr
    receipt = json.loads(done.stdout)
    held = receipt["scores"]["held_out"]
    n = held["current"]["n"]
    assert receipt["decision"] == "promoted", receipt["why"]
    assert held["candidate"]["mean"] == 1.0 and held["current"]["mean"] == 0.0
    verdicts = receipt["judge"]["held_out"]
    assert (verdicts["wins"], verdicts["ties"], verdicts["losses"]) == (n, 0, 0)
    assert verdicts["examples"][0]["verdicts"] == {"current_as_a": "B", "candidate_as_a": "A"}
    regression = receipt["scores"]["regression"]["current"]["n"]  # round 1's held-out, frozen
    asked = sums_judge.asked[2:]  # after the checks of the dry run and the round
    assert len(asked) == 2 * (n + regression)  # each question in both orders:
    assert sorted(asked) == sorted((q, b, a) for q, a, b in asked)  # (A, B), then (B, A)
    assert (
        alias_history(server, "sums")["log"][-1]["checkpoint"] == receipt["candidate"]["checkpoint"]
    )

    wrong = sums(tmp_path / "wrong.jsonl", range(100, 124), lambda i: "11", "wrong")
    refused = learn(home, server, *judged, "--traces", wrong)
    assert refused.returncode == 0, refused.stderr
    second = json.loads(refused.stdout)
    assert second["decision"] == "refused", second["why"]
    for name in ("held_out", "regression"):  # regression: the frozen round-1 questions
        verdicts = second["judge"][name]
        assert verdicts["wins"] == 0 and verdicts["losses"] > 0, verdicts
    log = alias_history(server, "sums")["log"]
    assert log[-1]["checkpoint"] == receipt["candidate"]["checkpoint"]  # unchanged


def test_our_servers_model_as_the_judge(tmp_path, server, tiny_model):
    """``--judge`` naming the model the training server serves (no --judge-base-url): the
    round completes and its receipt counts the verdicts (the tiny model's are mostly noise)."""
    home = tmp_path / "home"
    cli("alias", "set", "self", str(tiny_model), "--base-url", server.base_url)
    data = sums(tmp_path / "t.jsonl", range(12), lambda i: "10", "self")
    done = learn(home, server, "--alias", "self", "--traces", data, "--judge", str(tiny_model),
                 "--epochs", "1", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    receipt = json.loads(done.stdout)
    verdicts = receipt["judge"]["held_out"]
    assert receipt["judge"]["model"] == str(tiny_model)
    assert receipt["judge"]["base_url"] == server.base_url
    n = receipt["scores"]["held_out"]["current"]["n"]
    assert verdicts["wins"] + verdicts["ties"] + verdicts["losses"] == n > 0
    assert 1 <= len(verdicts["examples"]) <= 3


def test_a_bad_judge_is_one_line_and_changes_nothing(
    tmp_path, server, tiny_model, sums_judge, monkeypatch
):
    """Unreachable, too slow (past the check's bounded timeout, 1 s here), answering errors,
    or not knowing the model: one line before any training, no round folder, the alias as it
    was."""
    from rlcli.demo.run import free_port
    from rlcli.learn import judge

    monkeypatch.setattr(judge, "CHECK_TIMEOUT_S", 1.0)  # cli() runs in this process

    home = tmp_path / "home"
    cli("alias", "set", "badjudge", str(tiny_model), "--base-url", server.base_url)
    data = sums(tmp_path / "t.jsonl", range(12), lambda i: "10", "bad")
    closed = f"http://127.0.0.1:{free_port()}"
    cases = [
        (("--judge", SumsJudge.MODEL, "--judge-base-url", closed), "no answer within"),
        (("--judge", "silent", "--judge-base-url", sums_judge.url),
         "no answer within 1 s (ReadTimeout)"),
        (("--judge", "broken", "--judge-base-url", sums_judge.url),
         "answered 500: the judge fell over"),
        (("--judge", "nosuch", "--judge-base-url", sums_judge.url),
         f"does not know this model (it serves {SumsJudge.MODEL})"),
        (("--judge", "nosuch"), "does not know this model"),  # our server's 404
    ]  # fmt: skip
    for args, expected in cases:
        result = learn(home, server, "--alias", "badjudge", "--traces", data, *args)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, (args, result.stderr)
        assert expected in result.stderr, (args, result.stderr)
    assert not list((home / "learn" / "badjudge").glob("0*"))
    assert len(alias_history(server, "badjudge")["log"]) == 1


# ---- --watch -------------------------------------------------------------------------------


def test_watch_rounds_as_traces_arrive_and_stops_on_ctrl_c(tmp_path, server, tiny_model):
    """``learn --watch`` in a subprocess: it waits on an empty folder, runs a round when judged
    traces arrive, and Ctrl-C while it waits again, or in the middle of the next round's
    training, stops it cleanly (exit 130, no receipt, the alias as the last finished round
    left it); a rerun finishes the interrupted round, each training step once, and trains
    nothing twice."""
    from rlcli.runs.runner import metric_values

    home, folder = tmp_path / "home", tmp_path / "arriving"
    folder.mkdir()
    cli("alias", "set", "watched", str(tiny_model), "--base-url", server.base_url)
    rounds = home / "learn" / "watched"

    def watch(log: Path) -> subprocess.Popen:
        argv = [sys.executable, "-m", "rlcli.cli.main", "learn", "--alias", "watched",
                "--traces", str(folder), "--base-url", server.base_url, *FAST, "--batch-size",
                "4", "--watch", "--min-traces", "8", "--every", "0.2", "--json"]  # fmt: skip
        env = {**os.environ, "RLCLI_HOME": str(home)}
        return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)

    def arrive(name: str, numbers: range) -> None:
        staged = traces(tmp_path / name, numbers, lambda i: "zebra", name)
        staged.rename(folder / name)  # whole, as an importer's finished file appears

    def wait_for(ready, proc: subprocess.Popen, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, "learn --watch ended early"
            assert time.monotonic() < deadline
            time.sleep(0.1)

    def stopped(proc: subprocess.Popen, log: Path) -> str:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 130, log.read_text()[-2000:]
        return log.read_text()

    first = watch(tmp_path / "1.log")
    wait_for(lambda: "waiting: " in (tmp_path / "1.log").read_text(), first)  # nothing yet
    arrive("a.jsonl", range(12))
    wait_for(lambda: (rounds / "001" / "receipt.json").exists(), first)
    wait_for(lambda: (tmp_path / "1.log").read_text().count("waiting: ") >= 2, first)
    out = stopped(first, tmp_path / "1.log")  # between rounds
    assert out.strip().splitlines()[-1].startswith("error: learn --watch: stopped"), out[-2000:]
    receipt = json.loads((rounds / "001" / "receipt.json").read_text())
    promoted = receipt["decision"] == "promoted"
    assert len(alias_history(server, "watched")["log"]) == 1 + promoted

    second = watch(tmp_path / "2.log")
    arrive("b.jsonl", range(100, 112))
    wait_for(lambda: bool(metric_values(rounds / "002" / "run", "train_mean_nll").get(
        "train_mean_nll")), second)  # fmt: skip
    out = stopped(second, tmp_path / "2.log")  # within a round, mid-training
    last = out.strip().splitlines()[-1]  # the step under way saved, then: rerun learn
    assert last.startswith("error: learn --alias watched: round 2 stopped in training"), last
    assert not (rounds / "002" / "receipt.json").exists()
    assert len(alias_history(server, "watched")["log"]) == 1 + promoted  # not half-promoted

    rerun = learn(home, server, "--alias", "watched", "--traces", folder, "--batch-size", "4",
                  "--json")  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["round"] == 2
    plan = json.loads((rounds / "002" / "plan.json").read_text())
    steps = metric_values(rounds / "002" / "run", "train_mean_nll")["train_mean_nll"]
    rows = plan["traces"]["trained_on"]
    assert len(steps) == 2 * (rows // min(4, rows))  # each step once, across Ctrl-C and rerun
    again = learn(home, server, "--alias", "watched", "--traces", folder)
    assert again.returncode == 1 and "0 judged traces not used before" in again.stderr
    assert sorted(p.name for p in rounds.glob("0*")) == ["001", "002"]


def test_the_python_api_plans_and_refuses_like_the_cli(tmp_path, server, tiny_model, monkeypatch):
    """``rlcli.learn_round(LearnOptions(...))``: the dry run's plan is the CLI's ``--dry-run
    --json``; too few judged traces is the CLI's one line as an RlcliError."""
    import rlcli

    monkeypatch.setenv("RLCLI_HOME", str(tmp_path / "home"))
    aliased = cli("alias", "set", "api", str(tiny_model), "--base-url", server.base_url)
    assert aliased.returncode == 0
    data = sums(tmp_path / "api.jsonl", range(12), lambda i: "10", "api")
    options = rlcli.LearnOptions(alias="api", traces=[str(data)], base_url=server.base_url)
    messages = []
    dry = dataclasses.replace(options, dry_run=True)
    plan = rlcli.learn_round(dry, on_progress=messages.append)
    shown = json.loads(learn(tmp_path / "home", server, "--alias", "api", "--traces", data,
                             "--dry-run", "--json").stdout)  # fmt: skip
    assert {k: plan[k] for k in ("round", "method", "traces")} == {
        k: shown[k] for k in ("round", "method", "traces")
    }
    assert messages and all(isinstance(m, rlcli.Message) for m in messages)
    few = dataclasses.replace(options, min_traces=50)
    with pytest.raises(rlcli.RlcliError, match="learn --alias api: 12 judged traces"):
        rlcli.learn_round(few)

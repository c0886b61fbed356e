"""`rlcli eval rl` on the session's real server with the tiny model: every environment gives the
same numbers for the same seed and other tasks for another; --json carries every task;
--compare shows an SFT-taught checkpoint ahead of its base model; bad input is one line.

The tiny model's answers are noise, so "stable" means identical per-task responses and rewards
run to run (sampled at temperature 1, where the seed matters), not good scores.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import GSM8K, cli, run_rlcli

DEAD_URL = "http://127.0.0.1:9"
KEYS = {
    "env", "source", "tasks", "seed", "temperature", "max_new_tokens", "pass_threshold",
    "renderer", "base_url", "context", "policy", "model", "checkpoint", "mean_reward", "std_reward",
    "pass_rate", "passed", "tokens_generated", "seconds", "tasks_per_s", "tokens_per_s",
    "per_task",
}  # fmt: skip
TASK_KEYS = {
    "id", "prompt", "response", "reward", "passed", "tokens", "turns", "prompt_tokens", "adapter",
}  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def graded(result: dict) -> list[tuple]:
    return [(t["id"], t["response"], t["reward"], t["passed"]) for t in result["per_task"]]


def eval_cli(server, tiny_model, *extra):
    """`rlcli eval rl` in this process (conftest.cli); test_compare runs it as a process."""
    return cli(
        "eval", "rl", "--model", str(tiny_model), "--base-url", server.base_url,
        "--max-new-tokens", "6", *extra,
    )  # fmt: skip


def test_json_has_every_task_and_a_seed_gives_the_same_numbers(server, tiny_model):
    args = ("--env", "arithmetic", "--tasks", "6", "--temperature", "1", "--json")
    first, again = (eval_cli(server, tiny_model, *args, "--seed", "3") for _ in range(2))
    assert first.returncode == 0, first.stderr[-3000:]
    a, b = json.loads(first.stdout), json.loads(again.stdout)
    assert set(a) == KEYS and all(set(t) == TASK_KEYS for t in a["per_task"])
    assert a["tasks"] == 6 and a["policy"] == "base" and a["checkpoint"] is None
    assert graded(a) == graded(b) and a["mean_reward"] == b["mean_reward"]
    assert a["per_task"][0]["prompt"].startswith("What is ") and a["tokens_generated"] > 0
    assert 0 <= a["pass_rate"] <= 1 and a["tasks_per_s"] > 0
    assert "scoring base: 6/6 tasks" in first.stderr  # progress on stderr, not in the JSON
    other = json.loads(eval_cli(server, tiny_model, *args, "--seed", "4").stdout)
    assert [t["prompt"] for t in other["per_task"]] != [t["prompt"] for t in a["per_task"]]


@pytest.mark.parametrize("env", ["gsm8k", "niah:words=120", "jsonl"])
def test_each_environment_is_stable_for_a_seed(tmp_path, server, tiny_model, env):
    from rlcli.client.evaluate import EvalOptions, evaluate

    if env == "jsonl":
        rows = [{"question": f"What is {i} times 3?", "answer": 3 * i} for i in range(6)]
        env = str(write_jsonl(tmp_path / "qa.jsonl", rows))
    opts = EvalOptions(
        env=env, model=str(tiny_model), base_url=server.base_url, tasks=4, max_new_tokens=6,
        temperature=1.0, seed=5, gsm8k_dir=str(GSM8K),
    )  # fmt: skip
    first, again = evaluate(opts), evaluate(opts)
    assert graded(first) == graded(again) and first["tasks"] == 4
    assert first["std_reward"] == again["std_reward"]
    other = evaluate(replace(opts, seed=6))
    assert [t["id"] for t in other["per_task"]] != [t["id"] for t in first["per_task"]]
    json.dumps(first)  # JSON-able as it is


@pytest.mark.slow
def test_compare_shows_an_sft_checkpoint_ahead_of_its_base_model(tmp_path, server, tiny_model):
    """SFT teaches one answer ("7") to a set of questions; the same questions as a JSONL
    environment: the checkpoint passes where the base model does not."""
    questions = [f"What is the secret code of box {i}?" for i in range(8)]
    env = write_jsonl(tmp_path / "codes.jsonl", [{"question": q, "answer": 7} for q in questions])
    chats = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "7"}]}
        for q in questions
    ]
    sft = cli(
        "train", "sl", "--dataset", str(write_jsonl(tmp_path / "sft.jsonl", chats)),
        "--model", str(tiny_model), "--base-url", server.base_url, "--batch-size", "8",
        "--epochs", "25", "--lr", "1e-2", "--lora-rank", "8", "--save-every", "0",
        "--log-path", str(tmp_path / "sft"), "--json",
    )  # fmt: skip
    assert sft.returncode == 0, sft.stderr[-3000:]
    summary = json.loads(sft.stdout)
    sampler = summary["sampler_path"]
    # --model is not needed: the server names the checkpoint's base model
    result = run_rlcli(
        "eval", "rl", "--env", str(env), "--checkpoint", sampler, "--compare", "--tasks", "8",
        "--max-new-tokens", "4", "--base-url", server.base_url, "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    base, trained = out["base"], out["checkpoint"]
    assert base["model"] == trained["model"] == str(tiny_model)
    assert trained["checkpoint"] == sampler and base["checkpoint"] is None
    assert [t["id"] for t in base["per_task"]] == [t["id"] for t in trained["per_task"]]
    assert trained["pass_rate"] >= 0.75 and base["pass_rate"] == 0.0, trained["per_task"]
    assert out["difference"]["mean_reward"] == trained["mean_reward"] - base["mean_reward"] > 0.5
    table = cli(
        "eval", "rl", "--env", str(env), "--checkpoint", sampler, "--compare", "--tasks", "2",
        "--max-new-tokens", "4", "--base-url", server.base_url,
    )  # fmt: skip
    assert table.returncode == 0, table.stderr[-3000:]
    for column in ("base", "checkpoint", "difference", "pass rate", "tokens/s"):
        assert column in table.stdout
    # a state checkpoint is not samplable: one line naming the sampler path to use
    state = summary["state_path"]
    wrong = eval_cli(server, tiny_model, "--env", str(env), "--checkpoint", state)
    assert wrong.returncode == 1 and len(wrong.stderr.strip().splitlines()) == 1
    assert "a training state (weights/), not samplable" in wrong.stderr


def test_bad_input_is_one_line(tmp_path, server, tiny_model):
    def fails(*args, where: str) -> None:
        result = cli("eval", "rl", *args)
        assert result.returncode == 1, result.stdout
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and where in lines[0], result.stderr

    model = ("--model", str(tiny_model))
    fails(*model, "--env", "gsm9k", "--base-url", DEAD_URL, where="--env gsm9k: unknown environ")
    fails(*model, "--env", "arithmetic", "--base-url", DEAD_URL, where="no Tinker server answered")
    fails(
        *model, "--env", "arithmetic", "--base-url", server.base_url, "--checkpoint",
        "tinker://no-such-run/sampler_weights/final", where="has no such checkpoint",
    )  # fmt: skip
    # a bare name may be an alias (rlcli alias): the server is asked, and says it is neither
    fails(
        *model, "--env", "arithmetic", "--checkpoint", "final", "--base-url", server.base_url,
        where="final: not a checkpoint path, and not an alias on",
    )  # fmt: skip
    fails(*model, "--env", "arithmetic", "--compare", where="--compare: pass --checkpoint")
    harbor = tmp_path / "task"
    harbor.mkdir()
    (harbor / "instruction.md").write_text("Fix the bug.\n")
    # a Harbor task folder is an environment of eval rl; a broken one is one line naming it
    fails(*model, "--env", str(harbor), where=f"task {harbor}: no task.toml")

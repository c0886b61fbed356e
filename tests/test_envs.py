"""The environment registry without a server: each environment's problems (seeded, splits
apart, bad input one line) and its grading through the cookbook env's own ``step``."""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import GSM8K
from rlcli import envs
from rlcli.envs.answer import is_correct
from rlcli.errors import RlcliError


@pytest.fixture(scope="module")
def renderer(tiny_model):
    from tinker_cookbook import renderers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return renderers.get_renderer("qwen3_instruct", tokenizer)


def grade(env, row, renderer, text: str, stop: bool = True) -> float:
    """The reward the cookbook env gives the answer ``text`` (ended by the stop token or not)."""
    problem = env.make_env(row, renderer)
    prompt, stop_condition = asyncio.run(problem.initial_observation())
    assert prompt.length > 0 and stop_condition == renderer.get_stop_sequences()
    tokens = renderer.tokenizer.encode(text) + (list(stop_condition) if stop else [])
    return asyncio.run(problem.step(tokens)).reward


def test_numeric_and_exact_match():
    assert is_correct("I think it is 41, no: 42", "42")
    assert is_correct("so \\boxed{1,000} dollars", "1000") and is_correct("7.0", "7")
    assert not is_correct("\\boxed{41} but 42", "42")  # the boxed value wins
    assert not is_correct("no number here", "42")
    assert is_correct("  Paris. ", "paris") and is_correct("\\boxed{New  York}", "new york")
    assert not is_correct("The answer is Paris", "Paris")  # exact, not contains


def test_generated_envs_are_seeded_and_their_splits_apart():
    arithmetic = envs.get("arithmetic")
    first = list(arithmetic.problems("test", 3, 50))
    assert first == list(arithmetic.problems("test", 3, 50))  # same seed, same tasks, same order
    assert first != list(arithmetic.problems("test", 4, 50))
    pairs = {(r["x"], r["y"]) for r in arithmetic.problems("train", 3, 2000)}
    assert pairs.isdisjoint({(r["x"], r["y"]) for r in arithmetic.problems("test", 3, 500)})
    assert len(arithmetic.problems("train", 0, 300)[:7]) == 7  # slices read lazily

    niah = envs.get("niah:words=300,depth=0.25")
    row = niah.problems("test", 0, 1)[0]
    assert row == niah.problems("test", 0, 1)[0]
    text = row["question"]
    needle = f"is {row['answer']}."
    assert 300 <= len(text.split()) < 360 and text.count(needle) == 1
    assert 0.15 < text.index(needle) / len(text) < 0.35  # a quarter of the way in
    assert row != niah.problems("train", 0, 1)[0]
    depths = {r["depth"] for r in envs.get("niah").problems("test", 0, 5)}
    assert len(depths) == 5  # without depth=, each problem has its own


def test_grading_through_the_cookbook_envs(renderer, tmp_path):
    arithmetic = envs.get("arithmetic")
    row = arithmetic.problems("test", 0, 1)[0]
    right = str(row["x"] + row["y"])
    assert grade(arithmetic, row, renderer, right) == 1.0
    assert grade(arithmetic, row, renderer, right, stop=False) == pytest.approx(0.9)  # format
    assert grade(arithmetic, row, renderer, str(row["x"] + row["y"] + 1)) == 0.0

    niah = envs.get("niah:words=50")
    row = niah.problems("test", 1, 1)[0]
    assert grade(niah, row, renderer, f"It is {row['answer']}") == 1.0
    assert grade(niah, row, renderer, "1") == 0.0

    data = tmp_path / "qa.jsonl"
    lines = [
        {"question": "Capital of France?", "answer": "Paris"},
        {},
        {"question": "2+2?", "answer": 4, "id": 9},
    ]
    data.write_text("\n".join(json.dumps(r) if r else "" for r in lines) + "\n")
    own = envs.get(str(data))
    rows = own.rows("train")
    assert [r["id"] for r in rows] == ["row-1", "9"] and rows[1]["answer"] == "4"
    assert grade(own, rows[0], renderer, "paris.") == 1.0
    assert grade(own, rows[1], renderer, "\\boxed{4}") == 1.0
    assert grade(own, rows[1], renderer, "5") == 0.0


def test_gsm8k_is_the_cookbooks_math_env_with_its_few_shot_prefix(renderer):
    from tinker_cookbook.recipes.math_rl.math_env import MathEnv

    gsm8k = envs.get("gsm8k", gsm8k_dir=str(GSM8K))
    assert gsm8k.count("test") == 12 and len(gsm8k.rows("train")) == 36
    row = gsm8k.problems("test", 0, 1, shuffle=False)[0]
    assert row["question"].startswith("Nell has 7 boxes of 6 candles")
    assert row["id"] == "test-0" and row["answer"] == "31"  # after the cookbook's "####" parse
    env = gsm8k.make_env(row, renderer)
    assert isinstance(env, MathEnv) and env.convo_prefix == MathEnv.standard_fewshot_prefix()
    assert grade(gsm8k, row, renderer, "so \\boxed{31}") == 1.0
    assert grade(gsm8k, row, renderer, "31") == pytest.approx(-0.1)  # not boxed: wrong format
    shuffled = [r["id"] for r in gsm8k.problems("test", 5, 10)]
    assert shuffled == [r["id"] for r in gsm8k.problems("test", 5, 10)]
    assert shuffled != [r["id"] for r in gsm8k.problems("test", 6, 10)]


def test_bad_specs_are_one_line(tmp_path):
    def error(spec: str) -> str:
        with pytest.raises(RlcliError) as e:
            envs.get(spec)
        return str(e.value)

    assert "unknown environment; use gsm8k, arithmetic, niah" in error("gsm9k")
    assert "no such file" in error(str(tmp_path / "missing.jsonl"))
    assert "depth must be in [0, 1]" in error("niah:depth=2")
    assert "unknown setting 'size'" in error("niah:size=3")
    assert "takes no settings" in error("arithmetic:x=1")
    harbor = tmp_path / "task"
    harbor.mkdir()
    (harbor / "task.toml").write_text("[environment]\n")
    assert "Harbor tasks" in error(str(harbor)) and "rlcli train harbor" in error(str(harbor))
    assert "rlcli train harbor --dataset" in error(str(tmp_path))  # a folder of task folders
    assert "rlcli train harbor --dataset terminal-bench@2.0" in error("terminal-bench@2.0")
    bad = tmp_path / "bad.jsonl"
    rows = [{"question": "q", "answer": "a"}, {"question": "q"}, "x", {"question": "", "answer": 1}]
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n{oops\n")
    message = error(str(bad))
    assert "4 of 5 lines are not usable" in message
    for line in ("line 2: ", "line 3: ", "line 4: ", "line 5: not JSON"):
        assert line in message

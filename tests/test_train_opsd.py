"""`rlcli train opsd`: on-policy self-distillation from a prompts file, through the cookbook's
``distillation.train_on_policy`` on a real server with the tiny model. The prompts file's
formats and bad lines, the dry run without a server, the teacher (the student's base model, a
checkpoint, another server, a base model a server does not host) and the hint that only the
teacher sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_rlcli
from rlcli.data.chat import DataError
from rlcli.data.prompts import read_prompts
from rlcli.recipes.opsd import OpsdOptions

DEAD_URL = "http://127.0.0.1:9"
PROMPTS = [
    {"prompt": "What is the capital of France?"},
    {"prompt": "Count to three."},
    {"prompt": "Name a fruit."},
    {"prompt": "Say hello."},
]
MESSAGES = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue"},  # a logged answer: dropped
        ]
    },
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say yes."}]}]},
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def small(server_url, tiny_model, dataset, log_path, *extra) -> tuple[str, ...]:
    return (
        "train", "opsd", "--dataset", str(dataset), "--model", str(tiny_model),
        "--base-url", server_url, "--batch-size", "2", "--group-size", "2",
        "--max-tokens", "16", "--log-path", str(log_path), "--json", *extra,
    )  # fmt: skip


# ---- no server ------------------------------------------------------------------------------


def test_messages_last_user_turn_is_the_prompt_and_earlier_turns_its_context():
    rows = read_prompts([json.dumps(r) for r in PROMPTS[:1] + MESSAGES], "test")
    assert rows[0] == {"prompt": "What is the capital of France?", "context": []}
    assert rows[1] == {
        "prompt": "Name a color.",
        "context": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ],
    }
    assert rows[2] == {"prompt": "Say yes.", "context": []}


def test_bad_lines_are_listed_by_number_before_any_server_work(tmp_path):
    bad = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            PROMPTS[0],
            {"prompt": ""},
            "not json",
            {"messages": [{"role": "assistant", "content": "x"}]},
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
            {"question": "x"},
        ],
    )
    with pytest.raises(DataError) as e:
        read_prompts(bad.open(), str(bad))
    assert [err.line for err in e.value.errors] == [2, 3, 4, 5, 6]
    log = tmp_path / "run"
    result = run_rlcli("train", "opsd", "--dataset", str(bad), "--model", "./nowhere-model-x",
                       "--base-url", DEAD_URL, "--log-path", str(log))  # fmt: skip
    assert result.returncode == 1
    assert "--model ./nowhere-model-x: no such folder" in result.stderr  # flags first
    result = run_rlcli("train", "opsd", "--dataset", str(bad), "--model", str(tmp_path),
                       "--base-url", DEAD_URL)  # fmt: skip
    assert "no config.json" in result.stderr


def test_dry_run_needs_no_server_and_shows_the_issue_defaults(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS * 10 + MESSAGES)
    result = run_rlcli("train", "opsd", "--dataset", str(data), "--model", str(tiny_model),
                       "--base-url", DEAD_URL, "--dry-run", "--json",
                       "--teacher-hint", "Answer in French.")  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["prompts"], plan["prompts_with_context"], plan["steps"]) == (42, 1, 2)
    assert plan["samples_per_step"] == 32 * 4 and plan["teacher_sees_hint"]
    assert plan["teacher_model"] == str(tiny_model) and plan["teacher_checkpoint"] is None
    o = plan["options"]
    assert (o["batch_size"], o["group_size"], o["lr"], o["max_tokens"]) == (32, 4, 1e-4, 1024)
    assert (o["kl_coef"], o["kl_discount"], o["save_every"]) == (1.0, 0.0, 20)
    assert o["teacher"] == str(tiny_model) and o["teacher_base_url"] == DEAD_URL
    assert Path(o["log_path"]).name.startswith("opsd-")
    assert not Path(o["log_path"]).exists()
    # --steps and --learning-rate are the issue's spellings; a checkpoint teacher is of --model
    checkpoint = "tinker://run/sampler_weights/x"
    result = run_rlcli("train", "opsd", "--dataset", str(data), "--model", str(tiny_model),
                       "--base-url", DEAD_URL, "--dry-run", "--json", "--steps", "1",
                       "--learning-rate", "3e-4", "--teacher", checkpoint)  # fmt: skip
    plan = json.loads(result.stdout)
    assert plan["steps"] == 1 and plan["options"]["lr"] == 3e-4
    assert plan["teacher_checkpoint"] == checkpoint
    assert plan["teacher_model"] == str(tiny_model)


def test_bad_dataset_lines_fail_the_command_with_line_numbers(tmp_path, tiny_model):
    bad = write_jsonl(tmp_path / "bad.jsonl", [PROMPTS[0], "{", {"messages": []}])
    result = run_rlcli("train", "opsd", "--dataset", str(bad), "--model", str(tiny_model),
                       "--base-url", DEAD_URL, "--log-path", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 1
    assert "2 of 3 lines are not usable prompts; nothing was sent" in result.stderr
    assert "line 2: not JSON" in result.stderr and "line 3:" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--kl-coef", "0"), "--kl-coef 0.0: must be greater than 0"),
        (("--kl-discount", "1"), "--kl-discount 1.0: must be in [0, 1)"),
        (("--kl-penalty-coef", "0.1"), "not used by opsd (the teacher's KL weight is --kl-coef)"),
        (("--teacher-hint", " "), "--teacher-hint: empty"),
        (("--teacher", "./no-such-teacher"), "--teacher ./no-such-teacher: no such folder"),
    ],
)
def test_bad_flags_are_one_line(tmp_path, tiny_model, extra, message):
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    result = run_rlcli("train", "opsd", "--dataset", str(data), "--model", str(tiny_model),
                       "--base-url", DEAD_URL, "--dry-run", *extra)  # fmt: skip
    assert result.returncode == 1
    assert message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_options_defaults_are_the_issues():
    o = OpsdOptions(model="m", dataset="d")
    assert (o.batch_size, o.group_size, o.lr, o.max_tokens) == (32, 4, 1e-4, 1024)
    assert (o.kl_coef, o.kl_discount, o.save_every, o.max_steps) == (1.0, 0.0, 20, None)

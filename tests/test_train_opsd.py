"""`rlcli train opsd`: on-policy self-distillation from a prompts file, through the cookbook's
``distillation.train_on_policy`` on a real server with the tiny model. The prompts file's
formats and bad lines, the dry run without a server, the teacher (the student's base model, a
checkpoint, another server, a base model a server does not host) and the hint that only the
teacher sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli, run_rlcli
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
    result = cli("train", "opsd", "--dataset", str(bad), "--model", "./nowhere-model-x",
                 "--base-url", DEAD_URL, "--log-path", str(log))  # fmt: skip
    assert result.returncode == 1
    assert "--model ./nowhere-model-x: no such folder" in result.stderr  # flags first
    result = cli("train", "opsd", "--dataset", str(bad), "--model", str(tmp_path),
                 "--base-url", DEAD_URL)  # fmt: skip
    assert "no config.json" in result.stderr


def test_dry_run_needs_no_server_and_shows_the_issue_defaults(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS * 10 + MESSAGES)
    result = cli("train", "opsd", "--dataset", str(data), "--model", str(tiny_model),
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
    result = cli("train", "opsd", "--dataset", str(data), "--model", str(tiny_model),
                 "--base-url", DEAD_URL, "--dry-run", "--json", "--steps", "1",
                 "--learning-rate", "3e-4", "--teacher", checkpoint)  # fmt: skip
    plan = json.loads(result.stdout)
    assert plan["steps"] == 1 and plan["options"]["lr"] == 3e-4
    assert plan["teacher_checkpoint"] == checkpoint
    assert plan["teacher_model"] == str(tiny_model)


def test_bad_dataset_lines_fail_the_command_with_line_numbers(tmp_path, tiny_model):
    bad = write_jsonl(tmp_path / "bad.jsonl", [PROMPTS[0], "{", {"messages": []}])
    result = cli("train", "opsd", "--dataset", str(bad), "--model", str(tiny_model),
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
    result = cli("train", "opsd", "--dataset", str(data), "--model", str(tiny_model),
                 "--base-url", DEAD_URL, "--dry-run", *extra)  # fmt: skip
    assert result.returncode == 1
    assert message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_kl_shown_is_never_negative_where_the_cookbooks_mean_is():
    """The recipe's ``teacher_kl`` is the mean of log p - log q over sampled tokens: negative on
    a batch where the teacher likes the samples more than the student (-0.003 read as a bug).
    The k3 estimate shown instead, exp(d) - 1 - d with d = log q - log p, never is."""
    import math

    import tinker

    from rlcli.compat.distill import kl_k3

    def datum(sampled, mask):
        n = len(sampled)
        return tinker.Datum(
            model_input=tinker.ModelInput.from_ints(list(range(n))),
            loss_fn_inputs={
                "logprobs": tinker.TensorData(data=sampled, dtype="float32", shape=[n]),
                "mask": tinker.TensorData(data=mask, dtype="float32", shape=[n]),
            },
        )

    sampled = [-1.0, -2.0, -0.5, -3.0]
    mask = [0.0, 1.0, 1.0, 1.0]  # the prompt's position is masked out
    teacher = [None, 0.0, -1.5, -0.2, -2.5]  # one per token of prompt + answer, first None
    d = [t - s for t, s in zip(teacher[2:], sampled[1:], strict=True)]  # 0.5, 0.3, 0.5
    k1 = -sum(d) / 3
    k3 = sum(math.expm1(x) - x for x in d) / 3
    assert k1 < 0 < k3
    assert abs(kl_k3([datum(sampled, mask)], [teacher]) - k3) < 1e-6
    same = [None, 0.0, *sampled[1:]]  # the teacher is the student: zero
    assert kl_k3([datum(sampled, mask)], [same]) == 0.0


def test_an_offline_hub_teacher_fails_in_seconds_with_one_line(tmp_path, tiny_model, server):
    """A hub id no cache holds, the hub unreachable: the tokenizer check asks the hub once
    (models/hub.py) instead of retrying each file for a minute; the server check says what is
    wrong."""
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    teacher = "Qwen/Qwen3-0.6B"
    result = cli(*small(server.base_url, tiny_model, data, tmp_path / "run", "--teacher", teacher),
                 env={"HF_ENDPOINT": DEAD_URL, "HF_HUB_OFFLINE": ""})  # fmt: skip
    assert result.returncode == 1 and "Retrying" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"error: --teacher {teacher}: the server at {server.base_url} ")
    assert f"hosts only {tiny_model}; start a server for the teacher" in errors[0]
    assert not (tmp_path / "run").exists()


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, tiny_model):
    from rlcli.models.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", vocab_size=800)
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    result = cli("train", "opsd", "--dataset", str(data), "--model", str(tiny_model),
                 "--teacher", str(other), "--base-url", DEAD_URL, "--dry-run")  # fmt: skip
    assert result.returncode == 1
    assert f"--teacher {other}: its tokenizer differs from --model's" in result.stderr


def test_options_defaults_are_the_issues():
    o = OpsdOptions(model="m", dataset="d")
    assert (o.batch_size, o.group_size, o.lr, o.max_tokens) == (32, 4, 1e-4, 1024)
    assert (o.kl_coef, o.kl_discount, o.save_every, o.max_steps) == (1.0, 0.0, 20, None)


# ---- the teacher seam, without a server -------------------------------------------------------


class ScriptedTeacherClient:
    """Stands in for a teacher sampling client's one call (``compute_logprobs``, awaited): logprob
    i of a sequence is ``token / 1000`` (so positions are checkable), optionally one value short
    as SkyRL was."""

    def __init__(self, short: bool = False) -> None:
        self.short, self.seen = short, []

    async def compute_logprobs(self, sequence):
        tokens = sequence.to_ints()
        self.seen.append(tokens)
        values = [t / 1000 for t in tokens[1:]]
        return values if self.short else [None, *values]


def test_hinted_teacher_scores_the_answer_at_the_students_positions():
    import asyncio

    import tinker

    from rlcli.compat import distill

    student_prompt, hinted_prompt, answer = [5, 6, 7], [9, 9, 9, 9, 5, 6, 7], [11, 12, 13]
    for short in (False, True):
        client = ScriptedTeacherClient(short=short)
        teacher = distill.Teacher(client, {tuple(student_prompt): hinted_prompt})
        sequence = tinker.ModelInput.from_ints(student_prompt + answer)
        values = asyncio.run(teacher.compute_logprobs_async(sequence))
        assert client.seen == [hinted_prompt + answer]
        assert values == [None, 0.0, 0.0, 0.011, 0.012, 0.013]  # one per student token
        plain = asyncio.run(distill.Teacher(client).compute_logprobs_async(sequence))
        assert plain == [None, 0.006, 0.007, 0.011, 0.012, 0.013]
    with pytest.raises(RuntimeError, match="returned 2 logprobs for 4 tokens"):
        distill.align_prompt_logprobs([0.1, 0.2], 4)


# ---- end to end, on the session's server ------------------------------------------------------


@pytest.fixture(scope="module")
def zebra(server, tiny_model, tmp_path_factory) -> dict:
    """A checkpoint that `rlcli train sl` taught one fixed answer: a model that differs from
    the base model in a known way (its summary: state_path, sampler_path)."""
    folder = tmp_path_factory.mktemp("zebra")
    chats = [
        {"messages": [{"role": "user", "content": f"Question {i}: tell me something."},
                      {"role": "assistant", "content": "zebra zebra zebra zebra"}]}
        for i in range(8)
    ]  # fmt: skip
    sft = cli("train", "sl", "--dataset", str(write_jsonl(folder / "sft.jsonl", chats)),
              "--model", str(tiny_model), "--base-url", server.base_url, "--batch-size",
              "8", "--epochs", "30", "--lr", "1e-2", "--lora-rank", "8", "--save-every",
              "0", "--log-path", str(folder / "sft"), "--json")  # fmt: skip
    assert sft.returncode == 0, sft.stderr[-3000:]
    return json.loads(sft.stdout)


@pytest.mark.slow
def test_prompt_and_messages_files_train_and_a_checkpoint_teaches(
    tmp_path, server, tiny_model, zebra
):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    first = run_rlcli(*small(server.base_url, tiny_model, prompts, tmp_path / "a", "--steps", "2",
                             "--lr", "1e-2"))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout)
    assert summary["sampler_path"].startswith("tinker://") and "step 2/2" in first.stderr
    # rollouts are counted per step (2 prompts x 2 samples), not across steps
    assert "sampling rollouts 4/4" in first.stderr and "/8" not in first.stderr
    # the default teacher is the student's own base model: the LoRA starts at zero, so the
    # student and the teacher agree at the first step
    assert abs(summary["first_teacher_kl"]) < 1e-4
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1] and all("teacher_kl" in r for r in rows)
    assert all(r["rlcli/teacher_kl_k3"] >= 0 for r in rows)
    # {"messages"} with context, taught by a checkpoint that SFT taught one fixed answer
    messages = write_jsonl(tmp_path / "messages.jsonl", MESSAGES)
    second = cli(*small(server.base_url, tiny_model, messages, tmp_path / "b",
                        "--teacher", zebra["sampler_path"]))  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    taught = json.loads(second.stdout)
    assert taught["teacher"] == zebra["sampler_path"]
    # that teacher finds the student's answers unlikely: both estimates of the KL are large
    assert taught["first_teacher_logp_diff"] > 1.0 and taught["first_teacher_kl"] > 0.5
    config = (tmp_path / "b" / "config.yaml").read_text()
    assert f"teacher: {zebra['sampler_path']}" in config
    # a teacher checkpoint the server does not have, or a training (not sampler) checkpoint,
    # is one line before any work
    missing = zebra["sampler_path"].rsplit("/", 1)[0] + "/nope"
    third = cli(*small(server.base_url, tiny_model, messages, tmp_path / "c",
                       "--teacher", missing))  # fmt: skip
    assert third.returncode == 1 and "--teacher " + missing + ": no such checkpoint" in (
        third.stderr
    )
    assert not (tmp_path / "c").exists()
    state = cli(*small(server.base_url, tiny_model, messages, tmp_path / "d",
                       "--teacher", zebra["state_path"]))  # fmt: skip
    assert state.returncode == 1 and "pass a sampler_weights/... path" in state.stderr


def test_the_hint_reaches_the_teacher_only(tmp_path, server, tiny_model, monkeypatch):
    """In-process: every request the SDK sends is recorded; the teacher's logprob requests
    carry the hint, the student's sampling requests never do."""
    import dataclasses

    import tinker
    from tinker_cookbook.distillation import train_on_policy
    from transformers import AutoTokenizer

    from rlcli.recipes import opsd

    hint = "HINT: always answer zebra."
    monkeypatch.setenv("TINKER_API_KEY", "tml-dummy")
    # undo what the run patches once the test ends
    monkeypatch.setattr(
        train_on_policy, "incorporate_kl_penalty", train_on_policy.incorporate_kl_penalty
    )
    monkeypatch.setattr(tinker.SamplingClient, "sample", tinker.SamplingClient.sample)
    sent = []
    original = tinker.SamplingClient._send_asample_request

    async def recording(self, request_id, num_samples, prompt, params, prompt_logprobs, *rest):
        sent.append((prompt.to_ints(), prompt_logprobs))
        return await original(self, request_id, num_samples, prompt, params, prompt_logprobs, *rest)

    monkeypatch.setattr(tinker.SamplingClient, "_send_asample_request", recording)
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:2])
    opts = OpsdOptions(
        model=str(tiny_model), dataset=str(data), base_url=server.base_url, batch_size=2,
        group_size=2, max_tokens=16, max_steps=1, log_path=str(tmp_path / "run"),
        teacher_hint=hint,
    )  # fmt: skip
    recipe = opsd.Opsd()
    plan, _ = recipe.prepare(opts)
    spec = recipe.spec(recipe.resolved(opts, plan, server.base_url), plan)
    summary = recipe.run_in_child(spec)
    assert summary["first_teacher_kl"] is not None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    teacher = [tokenizer.decode(t) for t, logprobs in sent if logprobs]
    student = [tokenizer.decode(t) for t, logprobs in sent if not logprobs]
    assert len(teacher) == len(student) == 4  # 2 prompts x 2 samples, one request each
    assert all(hint + "\n\n" in text for text in teacher)
    assert not any("HINT" in text for text in student)
    for p in PROMPTS[:2]:  # each prompt sampled twice, scored twice
        assert sum(p["prompt"] in text for text in student) == 2
        assert sum(hint + "\n\n" + p["prompt"] in text for text in teacher) == 2
    assert dataclasses.asdict(plan)["teacher_sees_hint"]


def test_a_teacher_on_a_second_server_and_a_base_model_a_server_lacks(
    tmp_path, tmp_path_factory, server, tiny_model
):
    import shutil

    from conftest import start_server
    from rlcli.launch import process

    other_model = Path(shutil.copytree(tiny_model, tmp_path / "teacher-model"))
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:2])
    # the student's server hosts only the student's model: one line naming both and the flag
    lacking = cli(*small(server.base_url, tiny_model, data, tmp_path / "a",
                         "--teacher", str(other_model)))  # fmt: skip
    assert lacking.returncode == 1
    line = lacking.stderr.strip().splitlines()[-1]
    assert f"--teacher {other_model}: the server at {server.base_url}" in line
    assert f"hosts only {tiny_model}" in line and "--teacher-base-url" in line
    assert not (tmp_path / "a").exists()
    home = tmp_path_factory.mktemp("teacher-home")
    teacher_server = start_server(home, other_model)
    try:
        # the default teacher (--model) asked of a server that hosts another model
        wrong = cli(*small(server.base_url, tiny_model, data, tmp_path / "b",
                           "--teacher-base-url", teacher_server.base_url))  # fmt: skip
        assert wrong.returncode == 1
        assert f"the server at {teacher_server.base_url} (--teacher-base-url) hosts only" in (
            wrong.stderr
        )
        result = cli(*small(server.base_url, tiny_model, data, tmp_path / "c",
                            "--teacher", str(other_model), "--steps", "1",
                            "--teacher-base-url", teacher_server.base_url))  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(result.stdout)["first_teacher_kl"] is not None
        # the teacher's server served a sampling session (the teacher) and trained nothing
        import httpx

        def get(path):
            url = teacher_server.base_url + "/api/v1/" + path
            return httpx.get(url, headers={"X-API-Key": "tml-dummy"}).json()

        sessions = [get(f"sessions/{sid}") for sid in get("sessions")["sessions"]]
        assert any(s["sampler_ids"] for s in sessions)
        assert not any(s["training_run_ids"] for s in sessions)
    finally:
        process.stop(home)


def test_stdin_prompts_are_kept_and_a_run_resumes_from_its_config(tmp_path, server, tiny_model):
    log = tmp_path / "run"
    stdin = "".join(json.dumps(r) + "\n" for r in PROMPTS[:2] + MESSAGES[:2])
    first = cli(*small(server.base_url, tiny_model, "-", log, "--steps", "1",
                       "--save-every", "1"), stdin=stdin)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    kept = log / "prompts.jsonl"
    assert read_prompts(kept.open(), str(kept)) == read_prompts(stdin.splitlines(), "stdin")
    assert not list(log.glob(".prompts*"))
    second = cli("train", "opsd", "--config", str(log / "config.yaml"), "--log-path",
                 str(log), "--steps", "2", "--json", stdin="")  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming in" in second.stderr and "step 2/2" in second.stderr
    steps = [json.loads(line)["step"] for line in (log / "metrics.jsonl").open()]
    assert steps == [0, 1]  # step 1 only: step 0 was not redone


@pytest.mark.slow
def test_opsd_moves_a_student_toward_its_teacher(tmp_path, server, tiny_model, zebra):
    """A student that SFT taught one fixed answer, distilled toward its base model (the
    default teacher): the reverse KL to the teacher falls, at every step. One pass over the
    prompts, so each step's KL is measured on prompts the student has not been trained on."""
    prompts = [{"prompt": f"Question {100 + i}: tell me something."} for i in range(20)]
    data = write_jsonl(tmp_path / "p.jsonl", prompts)
    result = cli(*small(server.base_url, tiny_model, data, tmp_path / "run",
                        "--batch-size", "4", "--group-size", "4", "--lr", "3e-3",
                        "--init-checkpoint", zebra["state_path"]))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    kl = [json.loads(line)["teacher_kl"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    print("teacher_kl per step:", kl)
    assert len(kl) == 5 and kl[0] > 2.0
    # At lr 1e-2 the steps were chaotic: the KL fell to a third on one CPU and not at all on
    # another (float32 both; only the kernels' summation order differs). At 3e-3 it falls
    # steadily on both: measured 6.49 -> 6.17, 5.76, 5.71, 5.69 on an AVX512 Xeon.
    assert all(k < kl[0] for k in kl[1:]) and max(kl[-2:]) < kl[0] - 0.5

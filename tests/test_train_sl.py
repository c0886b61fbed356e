"""`rlcli train sl` end to end on a real server with the tiny model, through the cookbook's
supervised recipe: the import pipe, learning, checkpoints, resume, held-out loss, bad input."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import RLCLI, cli, run_rlcli

EXAMPLES = Path(__import__("tinker_cookbook").__file__).parent / "example_data"
DEAD_URL = "http://127.0.0.1:9"


def rlcli_argv(*args) -> list[str]:
    return [*RLCLI, *args]


run = run_rlcli  # a process of its own: the import pipe, signals, an env read at import
quick = cli  # in this process (conftest.cli): refusals, plans, `runs`, runs that end by themselves


@pytest.fixture(scope="module")
def openai_dump(tmp_path_factory) -> Path:
    """The cookbook's 128 example conversations, as an OpenAI chat-completions log."""
    path = tmp_path_factory.mktemp("dumps") / "traces.jsonl"
    with path.open("w") as out:
        for line in (EXAMPLES / "conversations.jsonl").open():
            messages = json.loads(line)["messages"]
            record = {
                "request": {"model": "gpt-4o", "messages": messages[:-1]},
                "response": {"choices": [{"message": messages[-1]}]},
            }
            out.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text((EXAMPLES / "conversations.jsonl").read_text())
    return path


@pytest.mark.slow
def test_import_pipe_into_train_sl_learns_and_checkpoints(
    tmp_path, server, tiny_model, openai_dump
):
    run_dir = tmp_path / "run"
    train = rlcli_argv(
        "train", "sl", "--dataset", "-", "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(run_dir),
        "--batch-size", "16", "--lr", "5e-3", "--epochs", "2", "--save-every", "4",
        "--test-size", "0.2", "--json",
    )  # fmt: skip
    imp = rlcli_argv("import", str(openai_dump), "-f", "openai")
    pipeline = f"{shlex.join(imp)} | {shlex.join(train)}"
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", pipeline], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["held_out_loss"] > 0
    assert summary["state_path"].startswith("tinker://")
    rows = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").open()]
    assert rows and all(r["state_path"].startswith("tinker://") for r in rows)
    # stdin data is kept for resume, and no temporary file is left behind
    assert len((run_dir / "dataset.jsonl").read_text().splitlines()) == 128
    assert not list(run_dir.glob(".dataset*"))
    assert (
        "renderer: qwen3_instruct (ChatML chat template; matches the model's chat template "
        "exactly)" in result.stderr
    )
    assert "step 12/12" in result.stderr  # 102 train conversations / 16, 2 epochs
    # The trained checkpoint through the OpenAI endpoint: the greedy text `rlcli sample` gives.
    import openai

    question = "What is the capital of France?"
    sampled = quick(
        "sample", "-c", summary["sampler_path"], "-p", question, "--temperature", "0",
        "--max-tokens", "24", "--json", "--base-url", server.base_url,
    )  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="tml-dummy")
    answer = client.chat.completions.create(
        model=summary["sampler_path"], messages=[{"role": "user", "content": question}],
        temperature=0, max_tokens=24,
    )  # fmt: skip
    assert answer.choices[0].message.content == json.loads(sampled.stdout)["samples"][0]["text"]


def test_interrupted_run_resumes_from_its_last_checkpoint(tmp_path, server, tiny_model, chat_file):
    run_dir = tmp_path / "run"
    args = (
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(run_dir),
        "--batch-size", "2", "--save-every", "3", "--lr", "1e-3",
    )  # fmt: skip
    first = subprocess.Popen(rlcli_argv(*args), stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 8:
            break
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 130
    assert "Resume with:" in err and f"--config {run_dir}/config.yaml --log-path {run_dir}" in err
    done_before = len(metrics.read_text().splitlines())
    assert 8 <= done_before < 64

    second = quick(*args, "--json")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming in" in second.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    resumed_at = steps[done_before]
    assert 0 < resumed_at <= done_before  # continued from a checkpoint, not from step 0
    assert steps[-1] == 63  # 128 conversations / 2 = 64 steps


def test_dry_run_plans_without_a_server(tmp_path, tiny_model, chat_file):
    result = quick(
        "train", "sl", "--dataset", "-", "--model", str(tiny_model), "--base-url", DEAD_URL,
        "--dry-run", "--json", "--test-size", "0.25", "--batch-size", "8", "--seed", "5",
        "--log-path", str(tmp_path / "run"),
        stdin=chat_file.read_text(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["examples"] == 128 and plan["held_out"] == 32 and plan["train_examples"] == 96
    assert plan["batches_per_epoch"] == 12 and plan["steps"] == 12
    assert plan["renderer"] == "qwen3_instruct"
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    # The token counts are what the cookbook's own dataset builder will feed the recipe.
    from rlcli.recipes import sl

    spec = {"options": {**plan["options"], "model": str(tiny_model)}, "plan": plan}
    spec["plan"]["dataset_path"] = str(chat_file)
    train_ds, test_ds = sl.SL().cookbook_config(spec).dataset_builder()
    batches = [train_ds.get_batch(i) for i in range(len(train_ds))]
    assert plan["tokens_per_epoch"] == sum(d.model_input.length for b in batches for d in b)
    assert plan["held_out_tokens"] == sum(d.model_input.length for d in test_ds.get_batch(0))


def test_bad_dataset_lines_are_reported_and_nothing_is_sent(tmp_path, tiny_model):
    data = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    data.write_text(
        json.dumps(good) + "\n{broken\n" + json.dumps({"messages": []}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "only a question"}]}) + "\n"
    )  # fmt: skip
    result = quick(
        "train", "sl", "--dataset", str(data), "--model", str(tiny_model),
        "--base-url", DEAD_URL, "--log-path", str(tmp_path / "run"),
    )  # fmt: skip
    assert result.returncode == 1
    err = result.stderr
    assert f"{data}: 3 of 4 lines are not usable chat data; nothing was sent" in err
    assert "line 2: not JSON" in err and "line 3: empty conversation" in err
    assert "line 4: no assistant turn to learn from" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_dead_server_is_one_clear_line(tmp_path, tiny_model, chat_file):
    result = quick(
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--base-url", DEAD_URL, "--log-path", str(tmp_path / "run"),
    )  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no Tinker server answered at {DEAD_URL}")
    assert f"rlcli serve start --base-model {tiny_model}" in last


def test_bad_flags_are_refused(tmp_path, tiny_model, chat_file):
    base = ("train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model), "--dry-run")
    result = quick(*base, "--test-size", "1.5")
    assert result.returncode == 1 and "--test-size 1.5: must be in [0, 1)" in result.stderr
    result = quick(*base, "--batch-size", "500")
    assert result.returncode == 1 and "--batch-size 500: larger than the 128" in result.stderr
    result = quick("train", "sl", "--dataset", str(tmp_path / "nope"), "--model", "x/y")
    assert result.returncode == 1 and "no such file" in result.stderr
    result = quick(*base, "--frobnicate")
    assert result.returncode == 2
    assert result.stderr == (
        "error: rlcli train sl: No such option: --frobnicate (see 'rlcli train sl --help')\n"
    )
    result = quick(*base, "--batch-size", "many")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: rlcli train sl: Invalid value for '--batch-size'")


def test_a_wrong_api_key_is_one_line_before_the_run_folder(
    tmp_path, keyed_server, tiny_model, chat_file
):
    _, record = keyed_server
    result = quick(
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--base-url", record.base_url, "--log-path", str(tmp_path / "run"),
        env={"TINKER_API_KEY": "tml-wrong"},
    )  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the server at {record.base_url} refused the API key")
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


# ---- options, config files, checks before the run folder --------------------------------------


def metric(run_dir: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").open()]


def test_config_yaml_reproduces_the_run(tmp_path, server, tiny_model, chat_file):
    first, again = tmp_path / "first", tmp_path / "again"
    result = quick(
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(first), "--batch-size", "4",
        "--learning-rate", "2e-3", "--lora-rank", "8", "--max-steps", "3", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    config = (first / "config.yaml").read_text()
    assert "lr: 0.002" in config and "lora_rank: 8" in config and "max_steps: 3" in config
    assert (first / "config.json").exists()  # the cookbook's own record, untouched
    result = quick("train", "sl", "--config", str(first / "config.yaml"), "--log-path", str(again))
    assert result.returncode == 0, result.stderr[-3000:]
    body = [ln for ln in config.splitlines() if not ln.startswith("#")]
    assert [
        ln for ln in (again / "config.yaml").read_text().splitlines() if not ln.startswith("#")
    ] == body
    assert metric(again, "train_mean_nll") == pytest.approx(
        metric(first, "train_mean_nll"), rel=1e-4
    )


def test_missing_model_folder_and_bad_renderer_stop_before_the_run_folder(tmp_path, chat_file):
    base = ("train", "sl", "--dataset", str(chat_file), "--base-url", DEAD_URL)
    result = quick(*base, "--model", str(tmp_path / "no-model"), "--log-path", str(tmp_path / "r"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: --model {tmp_path / 'no-model'}: no such folder"
    result = quick(*base, "--model", "./tiny", "--renderer", "nope", "--log-path", str(tmp_path))
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "--model ./tiny: no such folder" in result.stderr
    assert not (tmp_path / "r").exists()


def test_bad_renderer_is_one_line(tmp_path, tiny_model, chat_file):
    result = quick(
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--base-url", DEAD_URL, "--renderer", "nope", "--log-path", str(tmp_path / "r"),
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().startswith(
        "error: --renderer nope: not a renderer the cookbook knows; known: role_colon"
    )
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_server_refusals_come_before_the_run_folder(tmp_path, server, tiny_model, chat_file):
    import httpx

    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text((tiny_model / "config.json").read_text())
    base = ("train", "sl", "--dataset", str(chat_file), "--base-url", server.base_url)
    result = quick(*base, "--model", str(other), "--log-path", str(tmp_path / "r"))
    assert result.returncode == 1, result.stderr
    assert f"--model {other}: the server at {server.base_url} serves {tiny_model}" in (
        result.stderr
    )
    assert not (tmp_path / "r").exists()
    caps = httpx.get(f"{server.base_url}/api/v1/get_server_capabilities").json()
    too_big = str(caps["max_lora_rank"] + 1)  # our server publishes it
    model = ("--model", str(tiny_model))
    result = quick(*base, *model, "--lora-rank", too_big, "--log-path", str(other))
    assert result.returncode == 1
    assert f"--lora-rank {too_big}: the server at {server.base_url} allows at most" in (
        result.stderr
    )
    assert not (other / "config.yaml").exists()


def test_wandb_offline_run_keeps_metrics_jsonl(tmp_path, server, tiny_model, chat_file):
    run_dir = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_API_KEY": "", "WANDB_DIR": str(tmp_path)}
    result = quick(
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(run_dir), "--batch-size", "8",
        "--max-steps", "2", "--wandb-project", "rlcli-test", "--wandb-name", "offline-sl",
        env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(metric(run_dir, "train_mean_nll")) == 2
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list(run_dir.iterdir())


def test_wandb_flag_without_a_key_online_is_one_line(tmp_path, tiny_model, chat_file):
    result = quick(
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--wandb-name", "lonely", "--dry-run",
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == "error: --wandb-name: name the project too (--wandb-project)"
    result = quick(
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--base-url", DEAD_URL, "--wandb-project", "p", "--log-path", str(tmp_path / "r"),
        env={"WANDB_MODE": "", "WANDB_API_KEY": ""},
    )  # fmt: skip
    assert result.returncode == 1
    assert "--wandb-project: set WANDB_API_KEY" in result.stderr


def test_wandb_flag_without_the_package_names_the_extra(tiny_model, chat_file):
    # The CLI as a user without wandb sees it: the package cannot be found.
    code = (
        "import sys, importlib.util; real = importlib.util.find_spec;"
        "importlib.util.find_spec = lambda n, *a: None if n == 'wandb' else real(n, *a);"
        "from rlcli.cli.main import main; sys.argv = ['rlcli'] + sys.argv[1:]; main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "train", "sl", "--dataset", str(chat_file),
         "--model", str(tiny_model), "--wandb-project", "p", "--dry-run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: --wandb-project/--wandb-name need the wandb package: pip install 'rlcli[wandb]'"
    )


# ---- the knobs: schedule, warmup, periodic held-out loss, what is trained, tables -------------


def test_schedule_warmup_eval_every_and_train_on_reach_a_parquet_run(
    tmp_path, server, tiny_model, chat_file
):
    import datasets

    rows = [json.loads(line) for line in chat_file.read_text().splitlines()[:40]]
    folder = tmp_path / "table"
    folder.mkdir()
    datasets.Dataset.from_list(rows[:20]).to_parquet(str(folder / "part-0.parquet"))
    datasets.Dataset.from_list(rows[20:]).to_parquet(str(folder / "part-1.parquet"))
    run_dir = tmp_path / "run"
    result = quick(
        "train", "sl", "--dataset", str(folder), "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(run_dir), "--batch-size", "8",
        "--test-size", "0.2", "--eval-every", "2", "--lr", "1e-3", "--lr-schedule", "cosine",
        "--warmup-steps", "2", "--train-on", "last", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    # 32 train conversations / 8 = 4 steps: warmup 1/2, 2/2, then cosine over the 2 left
    assert [m["learning_rate"] for m in metrics] == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])
    assert [m["step"] for m in metrics if "test/nll" in m] == [0, 2]  # before steps 0 and 2
    assert "held-out" in result.stderr and "lr 0.0005" in result.stderr
    assert json.loads(result.stdout)["held_out_loss"] > 0  # and once more at the end
    cookbook = json.loads((run_dir / "config.json").read_text())  # the recipe's own record
    assert cookbook["lr_schedule"] == "cosine"
    assert cookbook["dataset_builder"]["common_config"]["train_on_what"] == (
        "last_assistant_message"
    )
    kept = run_dir / "dataset.jsonl"  # the table's rows, kept for resume like stdin's
    assert [json.loads(line) for line in kept.open()] == [
        {"messages": [{"role": m["role"], "content": m["content"]} for m in r["messages"]]}
        for r in rows
    ]
    assert f"dataset: {kept}" in (run_dir / "config.yaml").read_text()
    shown = quick("runs", "show", str(run_dir))
    assert "last measured" in shown.stdout and "held-out loss (step 2)" in shown.stdout
    plotted = json.loads(quick("runs", "plot", str(run_dir), "--json").stdout)
    assert "held-out loss" in [p["label"] for p in plotted["panels"]]


def test_train_on_last_puts_weight_on_the_last_assistant_message_only(tmp_path, tiny_model):
    from rlcli.flags import saved
    from rlcli.recipes import sl

    turns = ["Hi.", "Hello there, how can I help?", "Name a colour.", "Blue."]
    chat = [
        {"role": r, "content": t} for r, t in zip(["user", "assistant"] * 2, turns, strict=True)
    ]
    data = tmp_path / "multi.jsonl"
    data.write_text(json.dumps({"messages": chat}) + "\n")
    weights = {}
    for train_on in sl.TRAIN_ON:
        opts = sl.SLOptions(
            model=str(tiny_model), dataset=str(data), batch_size=1, train_on=train_on
        )
        plan = {"dataset_path": str(data), "held_out": 0, "renderer": "qwen3_instruct"}
        plan["run_dir"] = str(tmp_path / "run")
        spec = {"options": saved(opts), "plan": plan}
        train_ds, _ = sl.SL().cookbook_config(spec).dataset_builder()
        (datum,) = train_ds.get_batch(0)
        weights[train_on] = datum.loss_fn_inputs["weights"].to_numpy().sum()
    assert 0 < weights["last"] < weights["all-assistant"]


def test_tables_and_their_refusals(tmp_path, tiny_model, chat_file):
    import datasets

    rows = [json.loads(line) for line in chat_file.read_text().splitlines()[:16]]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))  # an arrow folder
    base = ("train", "sl", "--model", str(tiny_model), "--base-url", DEAD_URL, "--dry-run")
    result = quick(*base, "--dataset", str(saved), "--json", "--batch-size", "4")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["examples"] == 16
    bad = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([{"prompt": "hi", "completion": "hello"}]).to_parquet(str(bad))
    result = quick(*base, "--dataset", str(bad))
    assert result.returncode == 1 and 'line 1: no "messages" field' in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    result = quick(*base, "--dataset", str(empty))
    assert result.returncode == 1 and "a folder with no parquet or arrow files" in result.stderr
    offline = {"HF_ENDPOINT": DEAD_URL, "HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": ""}
    started = time.monotonic()
    result = run(*base, "--dataset", "someone/chats:train", env=offline)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "--dataset someone/chats:train: no such file here, and the Hugging Face hub is " in (
        result.stderr
    )
    assert time.monotonic() - started < 30
    result = quick(*base, "--dataset", str(chat_file), "--eval-every", "2")
    assert result.returncode == 1 and "--eval-every 2: hold some conversations out" in (
        result.stderr
    )
    result = quick(*base, "--dataset", str(chat_file), "--warmup-steps", "16", "--batch-size", "8")
    assert result.returncode == 1 and "--warmup-steps 16: the run has 16 steps" in result.stderr


def test_lora_alpha_reaches_the_adapter_and_survives_a_resume(
    tmp_path, server, service, tiny_model, chat_file
):
    root = next(
        p / "checkpoints" for p in Path(server.log_path).parents if (p / "checkpoints").is_dir()
    )
    run_dir = tmp_path / "run"
    args = (
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(run_dir), "--batch-size", "16",
        "--save-every", "1", "--lora-rank", "8", "--lora-alpha", "64", "--json",
    )  # fmt: skip
    for steps in ("2", "3"):  # the second run resumes from the first's checkpoint
        result = quick(*args, "--max-steps", steps)
        assert result.returncode == 0, result.stderr[-3000:]
        run_id = json.loads(result.stdout)["state_path"].split("/")[2]
        assert json.loads((root / run_id / "run.json").read_text())["lora"]["alpha"] == 64
        saved = json.loads(
            (root / run_id / "weights" / "final" / "adapter_config.json").read_text()
        )
        assert saved["lora_alpha"] == 64 and saved["r"] == 8
    assert "resuming in" in result.stderr
    with pytest.raises(Exception, match=r"rlcli_lora_alpha: 'lots' is not a number"):
        service.create_lora_training_client(
            str(tiny_model), rank=8, user_metadata={"rlcli_lora_alpha": "lots"}
        ).result()


def test_lora_targets_put_lora_on_the_chosen_layers_only(tmp_path, server, tiny_model, chat_file):
    """--lora-targets attn: the server's adapter has LoRA on the attention projections alone
    (the Tinker API's train_mlp / train_unembed off), and training moved them."""
    from safetensors.torch import load_file

    root = next(
        p / "checkpoints" for p in Path(server.log_path).parents if (p / "checkpoints").is_dir()
    )
    result = quick(
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(tmp_path / "run"), "--batch-size", "16",
        "--max-steps", "2", "--lora-rank", "4", "--lora-targets", "attn", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_id = json.loads(result.stdout)["state_path"].split("/")[2]
    lora = json.loads((root / run_id / "run.json").read_text())["lora"]
    assert (lora["train_attn"], lora["train_mlp"], lora["train_unembed"]) == (True, False, False)
    final = root / run_id / "weights" / "final"
    targets = json.loads((final / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    weights = load_file(final / "adapter_model.safetensors")
    assert weights and all(".self_attn." in k for k in weights)
    assert any(float(v.abs().max()) > 0 for k, v in weights.items() if "lora_B" in k)
    bad = quick(
        "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
        "--base-url", server.base_url, "--lora-targets", "attn,embed", "--dry-run",
    )  # fmt: skip
    assert bad.returncode == 1
    assert "--lora-targets 'attn,embed': a comma list of attn, mlp, unembed ('embed'" in bad.stderr


def test_grad_accum_and_packing_make_the_update_of_one_big_batch(
    tmp_path, server, service, tiny_model, chat_file, monkeypatch
):
    """--batch-size 4 --grad-accum 2 --pack (two forward_backward requests a step, each with
    its conversations packed into one row) and --batch-size 8 (one request, a row each): same
    batches, same seed, the same weights after two steps (two runs: each train run costs ~1
    minute here). The accumulation hook itself, on a real client: the step's call becomes 2
    requests, results combined in order; packing alone: test_packing.py."""
    import asyncio

    import tinker
    from safetensors.torch import load_file
    from tinker import types

    from rlcli.compat import run_hooks

    sent = []
    plain = tinker.TrainingClient.forward_backward

    def counted(self, data, *args, **kwargs):
        sent.append(len(data))
        return plain(self, data, *args, **kwargs)

    monkeypatch.setattr(tinker.TrainingClient, "forward_backward", counted)
    monkeypatch.setattr(
        tinker.TrainingClient,
        "forward_backward_async",
        tinker.TrainingClient.forward_backward_async,
    )  # restored after the test
    run_hooks.install_grad_accum(2)
    trainer = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3 + i]),
            loss_fn_inputs={"target_tokens": [2, 3 + i, 4], "weights": [1.0, 1.0, 1.0]},
        )
        for i in range(5)
    ]

    async def step():
        future = await trainer.forward_backward_async(data, "cross_entropy")
        return await future.result_async()

    combined = asyncio.run(step())
    assert sent == [3, 2] and len(combined.loss_fn_outputs) == 5
    whole = plain(trainer, data, "cross_entropy").result()
    for a, b in zip(combined.loss_fn_outputs, whole.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].data, b["logprobs"].data, atol=1e-6)

    root = next(
        p / "checkpoints" for p in Path(server.log_path).parents if (p / "checkpoints").is_dir()
    )
    weights = {}
    for name, extra in (("packed", ("--batch-size", "4", "--grad-accum", "2", "--pack")),
                        ("whole", ("--batch-size", "8"))):  # fmt: skip
        result = quick(
            "train", "sl", "--dataset", str(chat_file), "--model", str(tiny_model),
            "--base-url", server.base_url, "--log-path", str(tmp_path / name), "--max-steps",
            "2", "--lora-rank", "4", "--lr", "1e-2", "--json", *extra,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        run_id = json.loads(result.stdout)["state_path"].split("/")[2]
        weights[name] = load_file(root / run_id / "weights" / "final" / "adapter_model.safetensors")
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        assert [r["num_sequences"] for r in rows] == [8, 8]
    assert weights["packed"].keys() == weights["whole"].keys()
    moved = 0.0
    for key, value in weights["whole"].items():
        assert torch.allclose(weights["packed"][key], value, atol=1e-5, rtol=1e-4), key
        moved = max(moved, float(value.abs().max())) if "lora_B" in key else moved
    assert moved > 1e-3  # the steps did change the weights


def test_pack_is_refused_by_a_server_that_does_not_mask_examples():
    from rlcli.errors import RlcliError
    from rlcli.recipes.preflight import Server

    tinker_like = Server.__new__(Server)  # the capabilities a Tinker or SkyRL server answers
    tinker_like.base_url, tinker_like.caps = "http://tinker.example", {"supported_models": []}
    with pytest.raises(RlcliError, match=r"--pack: the server at http://tinker.example does not"):
        tinker_like.check_packing("rlcli_segment_ids")


def test_lora_alpha_is_refused_by_a_server_that_does_not_take_one():
    from rlcli.errors import RlcliError
    from rlcli.recipes.preflight import Server

    tinker_like = Server.__new__(Server)  # the capabilities a Tinker or SkyRL server answers
    tinker_like.base_url, tinker_like.caps = "http://tinker.example", {"supported_models": []}
    tinker_like.check_lora_alpha(None)
    with pytest.raises(RlcliError, match=r"--lora-alpha 64: the server at http://tinker.example"):
        tinker_like.check_lora_alpha(64.0)

"""Issue 26's smaller truths: cheap checks before slow ones, values a user copies printed
whole, one run id everywhere, and the small refusals. In-process (typer's CliRunner, direct
calls) wherever no run is needed; servers are the session's shared one."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlcli.cli.main import app
from rlcli.errors import RlcliError

EXAMPLES = Path(__import__("tinker_cookbook").__file__).parent / "example_data"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def invoke(*args: str, **kwargs):
    return CliRunner().invoke(app, list(args), **kwargs)


# ---- item 4: cheap checks first --------------------------------------------------------------


def test_the_server_is_asked_about_a_hub_model_before_any_tokenizer_lookup(
    tmp_path, server, monkeypatch
):
    from tinker_cookbook import tokenizer_utils

    looked_up = []
    original = tokenizer_utils.get_tokenizer
    monkeypatch.setattr(
        tokenizer_utils, "get_tokenizer", lambda name: looked_up.append(name) or original(name)
    )
    chats = EXAMPLES / "conversations.jsonl"
    for command in (("sl", "--dataset", str(chats)), ("rl", "--dataset", "arithmetic")):
        result = invoke(
            "train", *command, "--model", HUB_ID, "--base-url", server.base_url,
            "--log-path", str(tmp_path / command[0]),
        )  # fmt: skip
        assert isinstance(result.exception, RlcliError), result.output
        assert f"--model {HUB_ID}: the server at {server.base_url} serves" in str(result.exception)
        assert not (tmp_path / command[0]).exists()
    assert looked_up == []  # the hub was never asked


def test_gsm8k_from_an_unreachable_hub_fails_at_once_with_the_folder_hint(monkeypatch):
    import datasets

    from rlcli.data import gsm8k

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", gsm8k.ENV_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a))
    with pytest.raises(RlcliError) as e:
        gsm8k.load_rows(None, "test")
    assert "hub is unreachable" in str(e.value) and "--gsm8k-dir FOLDER" in str(e.value)
    assert calls == []  # no retrying download was started


# ---- item 5: values a user copies are never cut ---------------------------------------------


def test_final_tables_print_every_value_whole_at_80_columns(capsys, monkeypatch):
    """train's "done" and export's key/value tables, and eval --compare's table, at every
    value length around the terminal's width (piped: 80 columns)."""
    from rlcli.cli import evaluate
    from rlcli.cli._output import emit

    monkeypatch.setenv("COLUMNS", "80")
    for n in range(50, 100):
        path = "tinker://" + "r" * (n - 30) + "/sampler_weights/000004"
        emit({"run_dir": "/tmp/run", "state_path": path, "final_loss": 1.5}, as_json=False)
        assert path in capsys.readouterr().out, n
        stats = {"model": "m", "checkpoint": path, "policy": "checkpoint", "tasks": 4}
        stats |= {"mean_reward": 0.5}
        stats |= {"std_reward": 0.1, "pass_rate": 0.5, "tokens_generated": 9}
        stats |= {"seconds": 1.0, "tasks_per_s": 4.0, "tokens_per_s": 9.0}
        base = {**stats, "checkpoint": None, "policy": "base"}
        result = {"env": "arithmetic", "tasks": 4, "seed": 0, "base": base}
        evaluate.table(result | {"checkpoint": stats, "difference": {"mean_reward": 0.1}})
        out = capsys.readouterr().out
        assert path in out and "…" not in out, n


# ---- item 6: one run id everywhere ------------------------------------------------------------


def test_export_takes_every_run_id_runs_takes(tmp_path, monkeypatch):
    import json

    from rlcli.runs import catalog, runner
    from rlcli.runs import folder as run_folder

    monkeypatch.setenv("RLCLI_HOME", str(tmp_path / "home"))
    inside = tmp_path / "home" / "runs" / "sl-20261201-101010"
    outside = tmp_path / "elsewhere" / "my-run"  # a --log-path folder, listed in the index
    for folder, name in ((inside, "in"), (outside, "out")):
        folder.mkdir(parents=True)
        run_folder.write_record(folder, {"id": folder.name, "status": "finished"})
        row = {"name": "final", "sampler_path": f"tinker://{name}/sampler_weights/final"}
        (folder / "checkpoints.jsonl").write_text(json.dumps(row) + "\n")
    runner.register_run(outside)
    for given, folder in (
        ("sl-20261201-101010", inside), ("sl-2026", inside), (str(inside), inside),
        ("my-run", outside), ("my-r", outside), (str(outside), outside),
    ):  # fmt: skip
        assert catalog.resolve(given) == folder.resolve()
        assert catalog.checkpoint_path(given, with_optimizer=False).startswith(
            f"tinker://{'in' if folder == inside else 'out'}/"
        ), given
    with pytest.raises(RlcliError, match="no run 'nope'"):
        catalog.checkpoint_path("nope", with_optimizer=False)


# ---- item 8: the small ones ----------------------------------------------------------------


def test_dataset_dash_at_a_terminal_and_an_empty_file_say_so(tmp_path, tiny_model):
    import os

    from rlcli import recipes

    main, replica = os.openpty()  # a real terminal on stdin: nothing is piped in
    try:
        with open(replica) as terminal:
            for recipe in (recipes.get("sl"), recipes.get("opsd")):
                opts = recipe.options(model=str(tiny_model), dataset="-")
                with pytest.raises(RlcliError) as e:
                    recipe.prepare(opts, stdin=terminal)
                assert str(e.value).startswith("--dataset -: stdin is a terminal"), e.value
                assert "--dataset - < FILE.jsonl" in str(e.value)
    finally:
        os.close(main)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = invoke("train", "sl", "--dataset", str(empty), "--model", str(tiny_model))
    assert str(result.exception) == f"{empty}: the file is empty (no chat data to read)"
    result = invoke("train", "sl", "--dataset", "-", "--model", str(tiny_model), input="")
    assert str(result.exception) == "stdin: nothing came in on stdin (no chat data to read)"


def test_eval_tasks_beyond_the_environment_are_refused_or_capped_with_a_line(tmp_path):
    from conftest import GSM8K
    from rlcli.client import evaluate

    dead = "http://127.0.0.1:9"
    big = evaluate.EvalOptions(env="arithmetic", tasks=10**7, model="m", base_url=dead)
    with pytest.raises(RlcliError, match=r"--tasks 10000000: at most 10000 for a generated"):
        evaluate.evaluate(big)
    said = []
    capped = evaluate.EvalOptions(
        env="gsm8k", gsm8k_dir=str(GSM8K), tasks=10**6, model="m", base_url=dead
    )
    with pytest.raises(RlcliError, match="no Tinker server answered"):
        evaluate.evaluate(capped, info=said.append)
    rows = sum(1 for line in (GSM8K / "test.jsonl").open() if line.strip())
    assert said == [f"--tasks 1000000: gsm8k has {rows} test tasks; scoring all of them"]


def test_eval_plain_progress_speaks_every_few_seconds(capsys):
    import time

    from rlcli.cli.evaluate import Progress

    progress = Progress()
    progress.tty, progress.EVERY_S = False, 0.05
    progress("base", 0, 1000)
    for done in (1, 2, 3):  # far below a tenth of the tasks, but time has passed
        time.sleep(0.06)
        progress("base", done, 1000)
    progress("base", 4, 1000)  # no time has passed: quiet
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"scoring base: {n}/1000 tasks" for n in range(4)]


def test_serve_status_without_a_server_says_how_to_start_one(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCLI_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["serve", "status"])
    assert result.exit_code == 3
    assert "start one: rlcli serve start --base-model MODEL" in result.output


def test_docker_up_stop_stops_the_dockerd_it_started(tmp_path):
    import contextlib
    import os
    import signal
    import subprocess

    script = Path(__file__).parent.parent / ".ci" / "docker-up.sh"
    # Stands where its dockerd's pid would be: a process of no parent here (init reaps it).
    pid = int(subprocess.run(["bash", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True).stdout)  # fmt: skip
    try:
        (tmp_path / "dockerd.pid").write_text(f"{pid}\n")
        env = {"RLCLI_DOCKER_ROOT": str(tmp_path), "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [str(script), "--stop"], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0 and "stopped" in done.stderr, done.stderr
        again = subprocess.run(
            [str(script), "--stop"], env=env, capture_output=True, text=True, timeout=60
        )
        assert again.returncode == 0 and "no dockerd of ours is running" in again.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_the_import_example_in_docs_runs_md_works_as_written(tmp_path, monkeypatch):
    import json
    import shlex

    docs = Path(__file__).parent.parent / "docs" / "runs.md"
    line = next(ln for ln in docs.read_text().splitlines() if ln.startswith("rlcli import "))
    argv = shlex.split(line.split("|")[0])[1:]
    dump = next(a for a in argv if a.endswith(".jsonl"))  # the example's file, made here
    messages = json.loads((EXAMPLES / "conversations.jsonl").open().readline())["messages"]
    record = {"request": {"messages": messages[:-1]}, "response": {"choices": [
        {"message": messages[-1]}]}}  # fmt: skip
    (tmp_path / dump).write_text(json.dumps(record) + "\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[0])["messages"] == messages

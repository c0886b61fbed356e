"""The Python API (``rlcli.api``, ``docs/python-api.md``): the documented example runs as it
stands against the shared tiny-model server, and the CLI's exits are exceptions."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).parent.parent / "docs" / "python-api.md"
EXAMPLES = Path(__import__("tinker_cookbook").__file__).parent / "example_data"


def example_blocks() -> list[str]:
    """The ``python`` code blocks of the doc's Example section, in order."""
    section = DOC.read_text().split("## Example", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def on_this_machine(code: str, model: Path, base_url: str) -> str:
    """The doc's model and server are the user's; the test's are the tiny ones."""
    assert '"HuggingFaceTB/SmolLM2-135M-Instruct"' in code or "base_url" in code
    code = code.replace('"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(str(model)))
    return code.replace('"http://127.0.0.1:8000"', repr(base_url))


def test_the_documented_example_trains_reports_and_exports(
    tmp_path, monkeypatch, server, tiny_model
):
    monkeypatch.chdir(tmp_path)  # the example's relative paths: chats.jsonl, runs/, adapter/
    rows = (EXAMPLES / "conversations.jsonl").read_text().splitlines()[:8]
    (tmp_path / "chats.jsonl").write_text("\n".join(rows) + "\n")
    train_block, _, eval_block = example_blocks()
    scope: dict = {}
    exec(on_this_machine(train_block, tiny_model, server.base_url), scope)

    assert [s.step for s in scope["steps"]] == [1, 2]
    assert all(s.total == 2 and "loss" in s.metrics for s in scope["steps"])
    assert len(scope["checkpoints"]) >= 2  # save_every=1, and the final one
    summary = scope["result"].summary
    assert Path(summary["run_dir"]).resolve() == (tmp_path / "runs" / "first").resolve()
    saved = [json.loads(line) for line in (tmp_path / "runs/first/checkpoints.jsonl").open()]
    assert summary["sampler_path"] == saved[-1]["sampler_path"]
    assert scope["checkpoints"][-1].sampler_path == saved[-1]["sampler_path"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert scope["exported"]["files"]
    # export also takes the run itself (its last checkpoint), as `rlcli export RUN` does
    from rlcli import export

    by_run = export(str(tmp_path / "runs" / "first"), "by-run", base_url=server.base_url)
    assert by_run["source"] == saved[-1]["sampler_path"]
    assert (tmp_path / "by-run" / "adapter_model.safetensors").is_file()
    # The run is an ordinary run folder: `rlcli runs show` reads it, finished.
    from rlcli.runs import catalog

    assert catalog.show(tmp_path / "runs" / "first")["status"] == "finished"

    exec(on_this_machine(eval_block, tiny_model, server.base_url), scope)
    assert scope["scores"]["tasks"] == 8
    assert set(scope["scores"]["difference"]) >= {"mean_reward", "pass_rate"}


def test_refusals_and_plans_without_a_server(tmp_path, tiny_model):
    from rlcli import RlcliError, SLOptions, train

    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join((EXAMPLES / "conversations.jsonl").read_text().splitlines()[:8]))
    events = []
    opts = SLOptions(
        model=str(tiny_model), dataset=str(data), batch_size=4, dry_run=True,
        log_path=str(tmp_path / "run"),
    )  # fmt: skip
    outcome = train(opts, on_progress=events.append)
    assert outcome.summary is None and outcome.plan.steps == 2
    assert outcome.options["dataset"] == str(data.resolve())
    assert opts.base_url is None  # the caller's options are left as they were
    assert any(e.text.startswith("renderer: ") for e in events)
    assert not (tmp_path / "run").exists()
    with pytest.raises(RlcliError, match=r"^--batch-size 0: must be"):
        train(SLOptions(model=str(tiny_model), dataset=str(data), batch_size=0))
    with pytest.raises(RlcliError, match=r"no such file"):
        train(SLOptions(model=str(tiny_model), dataset=str(tmp_path / "none.jsonl")))
    with pytest.raises(TypeError, match="not the options of a train command"):
        train(object())


def test_import_rlcli_stays_light():
    code = (
        "import sys, rlcli; from rlcli import train, evaluate, export, SLOptions, EvalOptions;"
        "print(sorted(m for m in ('torch', 'tinker', 'transformers', 'tinker_cookbook') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


SCRIPT = """
import sys
from rlcli import SLOptions, Step, train

model, data, base_url, run_dir = sys.argv[1:]
opts = SLOptions(model=model, dataset=data, base_url=base_url, batch_size=1, save_every=0,
                 log_path=run_dir)
try:
    train(opts, on_progress=lambda e: isinstance(e, Step) and print("step", e.step, flush=True))
except KeyboardInterrupt as e:
    print("KeyboardInterrupt:", e, flush=True)
    sys.exit(3)
"""


def test_ctrl_c_is_a_keyboard_interrupt_after_the_checkpoint(tmp_path, server, tiny_model):
    """As ``train`` on the command line: Ctrl-C saves a checkpoint at the step's end, then the
    script gets ``KeyboardInterrupt`` (the CLI exits 130)."""
    import signal

    from conftest import wait_for_steps

    data = tmp_path / "chats.jsonl"
    data.write_text((EXAMPLES / "conversations.jsonl").read_text())
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-c", SCRIPT, str(tiny_model), str(data), server.base_url]
    proc = subprocess.Popen([*argv, str(run_dir)], stdout=subprocess.PIPE, text=True)
    wait_for_steps(run_dir, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    assert "KeyboardInterrupt: interrupted (Ctrl-C) after step" in out
    saved = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").open()]
    assert saved and saved[-1]["sampler_path"]
    from rlcli.runs import catalog

    assert catalog.show(run_dir)["status"] == "interrupted"

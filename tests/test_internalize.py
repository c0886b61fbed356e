"""``rlcli internalize`` on the tiny model through the session's real server: the dry-run plan,
refusals of bad input (in process, no server), one end-to-end CLI run (with on-policy steps)
whose adapter ``/v1`` serves, the Python API with progress events, and resume of a finished
run (``runs cancel`` and resume mid-run are the train flow's, tested in test_run_control).
Whether it learns is measured on SmolLM2 by benchmarks/internalize_smollm2.py, not here (too
slow for CI)."""

from __future__ import annotations

import json

import pytest

from conftest import cli, run_rlcli

FACTS = (
    "Orla Finch lives in Lisbon. Bram Okafor lives in Nairobi.\n\n"
    "The weather is mild in spring and people walk in the parks near the river.\n\n"
    "Mira Stone lives in Kyoto. Tobias Reyes was born in 1987.\n"
)
FAST = ["--n-questions", "12", "--steps", "2", "--batch-size", "4", "--max-answer-tokens", "6"]


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    (folder / "facts.md").write_text(FACTS)
    return folder / "facts.md"


def _error(result, lines: int = 1) -> str:
    assert result.returncode != 0, result.stdout
    assert len(result.stderr.strip().splitlines()) == lines, result.stderr
    return result.stderr


def test_dry_run_plans_without_a_server(tiny_model, document, tmp_path):
    run_dir = tmp_path / "run"
    result = cli(
        "internalize", document, "--model", tiny_model, "--dry-run", "--json",
        "--base-url", "http://127.0.0.1:9", "--log-path", run_dir, "--n-questions", "12",
        "--test-size", "0.25", "--batch-size", "4", "--epochs", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["documents"][0]["name"] == str(document)
    assert plan["train_probes"] + plan["held_out_probes"] == 12
    assert plan["held_out_probes"] == 3  # ceil(0.25 * 12)
    assert plan["steps"] == 3 * 3  # 9 training probes, batches of 4, 3 epochs
    assert plan["teacher_model"] == str(tiny_model)
    assert plan["chunk_tokens"] > 0 and "chunk" in plan["chunking"]
    assert plan["options"]["documents"] == [str(document)]
    assert not run_dir.exists()  # nothing written


def test_bad_input_is_one_line_and_writes_nothing(tiny_model, document, tmp_path):
    run_dir = tmp_path / "run"
    common = ["--model", tiny_model, "--dry-run", "--log-path", run_dir]
    empty = tmp_path / "empty.md"
    empty.write_text("  \n\n")
    assert "empty" in _error(cli("internalize", empty, *common))
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"Orla\x00Finch")
    assert "binary" in _error(cli("internalize", binary, *common))
    assert "no such file" in _error(cli("internalize", tmp_path / "missing.md", *common))
    bad = tmp_path / "questions.jsonl"
    bad.write_text('{"question": "Where does Orla live?", "answer": "Lisbon"}\nnot json\n')
    # data files are checked as train's are: one line naming the file, then each bad line
    said = _error(cli("internalize", document, *common, "--questions", bad), lines=2)
    assert f"--questions {bad}: 1 of 2 lines" in said and "line 2: not JSON" in said
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"answer": "Lisbon"}\n')
    said = _error(cli("internalize", document, *common, "--questions", rows), lines=2)
    assert 'line 1: "question" is missing' in said
    small = _error(cli("internalize", document, *common, "--context-window", "64"))
    assert "--context-window 64: too small" in small
    assert "missing DOCUMENTS" in _error(cli("internalize", "--model", tiny_model))
    huge = tmp_path / "huge.md"
    huge.write_text("Orla Finch lives in Lisbon. " * 80_000)  # 2.2 MB
    assert "more than the 2,000,000 a document may have" in _error(
        cli("internalize", huge, *common)
    )
    assert not run_dir.exists()


def test_internalize_end_to_end_cli(server, tiny_model, document, tmp_path):
    """One real run through a subprocess: receipt in the folder and in --json, the adapter
    served by /v1 under its sampler path, and `runs list` sees the run."""
    run_dir = tmp_path / "run"
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        json.dumps({"question": "Where does Orla Finch live?", "answer": "Lisbon"}) + "\n"
        + json.dumps({"question": "Who lives in Kyoto?"}) + "\n"
        + json.dumps({"question": "Where was Tobias born?", "held_out": True}) + "\n"
    )  # fmt: skip
    result = run_rlcli(
        "internalize", document, "--model", tiny_model, "--base-url", server.base_url,
        "--log-path", run_dir, "--questions", questions, "--json", "--test-size", "0", *FAST,
        "--on-policy-steps", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["sampler_path"].startswith("tinker://")
    assert summary["state_path"].startswith("tinker://")
    receipt = summary["receipt"]
    assert receipt == json.loads((run_dir / "receipt.json").read_text())
    assert receipt["held_out"] == 1  # --test-size 0: only the row marked held_out
    assert set(receipt["scores"]) == {"base", "in_context", "internalized", "control"}
    assert any(p["question"] == "Where was Tobias born?" for p in receipt["probes"])
    probe = receipt["probes"][0]
    assert set(probe["answers"]) == set(probe["correct"]) == set(receipt["scores"])
    targets = [json.loads(line) for line in (run_dir / "targets.jsonl").read_text().splitlines()]
    kinds = {t["targets"] for t in targets}
    assert kinds == {"reference+teacher", "teacher"}  # "Who lives in Kyoto?" has no answer
    assert all(len(row) == 16 for t in targets for row in t["target_ids"])
    # --on-policy-steps: train opsd's loop in on_policy/, from the distilled adapter; its last
    # checkpoint is the run's adapter
    on_policy = [json.loads(line) for line in (run_dir / "on_policy/checkpoints.jsonl").open()]
    assert on_policy[-1]["sampler_path"] == summary["sampler_path"]

    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="tml-dummy")
    reply = client.chat.completions.create(
        model=summary["sampler_path"],
        messages=[{"role": "user", "content": "Where does Orla Finch live?"}],
        max_tokens=4,
    )
    assert reply.choices[0].message.content is not None

    listed = cli("runs", "list", "--json", env={"RLCLI_HOME": str(tmp_path / "home")})
    assert listed.returncode == 0, listed.stderr


def test_python_api_progress_and_resume(server, tiny_model, document, tmp_path):
    import rlcli
    from rlcli import InternalizeOptions

    events = []
    options = InternalizeOptions(
        documents=[str(document)], model=str(tiny_model), base_url=server.base_url,
        log_path=str(tmp_path / "run"), n_questions=8, max_steps=2, batch_size=4,
        max_answer_tokens=4, targets="reference",
    )  # fmt: skip
    outcome = rlcli.internalize(options, on_progress=events.append)
    assert outcome.summary["receipt"]["scores"]["internalized"] is not None
    steps = [e for e in events if isinstance(e, rlcli.Step)]
    assert [s.step for s in steps] == [1, 2] and "loss" in steps[0].metrics
    assert any("teacher answers" in e.text for e in events if isinstance(e, rlcli.Message))
    # Again on the same folder: it resumes, trains nothing more, and keeps the same adapter.
    again = rlcli.internalize(options)
    assert again.plan.resuming
    assert again.summary["sampler_path"] == outcome.summary["sampler_path"]
    # Another setting on the same folder is refused, naming it.
    with pytest.raises(rlcli.RlcliError, match="--top-k"):
        rlcli.internalize(InternalizeOptions(**{**options.__dict__, "top_k": 4}))

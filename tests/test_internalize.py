"""``rlcli internalize`` on the tiny model through the session's real server: the dry-run plan,
refusals of bad input (in process, no server), one end-to-end CLI run (with on-policy steps)
whose adapter ``/v1`` serves, the Python API with progress events, and resume of a finished
run, ``runs cancel`` mid-training and a rerun that resumes; and one learning test on
SmolLM2-135M-Instruct (slow): facts the base model cannot answer are answered, worded unlike
any probe, with the document absent, where the control (the base model reading unrelated text)
does not. How much it learns, on more and longer documents, is measured by
benchmarks/internalize_smollm2.py."""

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


def test_default_epochs_shrink_and_lr_rises_as_the_probes_grow(tiny_model, document, tmp_path):
    """8 passes while they fit in 56 steps, else as many as fit, at least 4: a step budget
    that does not grow linearly with the probes (a 20-fact document in under 3 minutes); the
    learning rate 1e-3 at 8 passes, 1e-3 x 8 / passes at fewer."""

    def plan(*flags):
        result = cli(
            "internalize", document, "--model", tiny_model, "--dry-run", "--json",
            "--base-url", "http://127.0.0.1:9", "--log-path", tmp_path / "run",
            "--n-questions", "24", "--test-size", "0", *flags,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    few = plan("--batch-size", "4")  # 24 probes: 6 steps a pass
    assert (few["epochs"], few["steps"], few["lr"]) == (8, 48, 1e-3)
    many = plan("--batch-size", "2")  # 12 steps a pass: 4 passes fit in 56 steps
    assert (many["epochs"], many["steps"], many["lr"]) == (4, 48, 2e-3)
    most = plan("--batch-size", "1")  # 24 steps a pass: never under 4 passes
    assert (most["epochs"], most["steps"]) == (4, 96)
    given = plan("--batch-size", "1", "--epochs", "2", "--lr", "5e-4")
    assert (given["epochs"], given["steps"], given["lr"]) == (2, 48, 5e-4)
    assert plan("--epochs", "16")["lr"] == 1e-3  # more passes keep the base rate


def test_the_teachers_reply_is_read_as_questions_and_auto_picks_the_writer(tmp_path):
    from rlcli.data.probes import written_questions
    from rlcli.recipes.internalize import InternalizeOptions, model_config, question_writer

    reply = (
        "Here are three questions:\n1. Where does Orla Finch live?\n2) When was it built?\n"
        "- Where does  orla finch live?\nQ3: Who?\nQuestion 4: What is the tower made of?\n"
        "B: 2. When was it built?\n"
        "The tower is tall."
    )
    assert written_questions(reply, 5) == [
        "Where does Orla Finch live?", "When was it built?", "What is the tower made of?"
    ]  # fmt: skip
    assert written_questions(reply, 1) == ["Where does Orla Finch live?"]
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096}
    ))  # fmt: skip

    def writer(model: str, asked: str = "auto") -> str:
        opts = InternalizeOptions(documents=["d"], model=model, question_writer=asked)
        return question_writer(opts, model_config(model))

    assert writer(str(big)) == "model"  # ~6.4e9 parameters
    assert writer(str(big), "templates") == "templates"
    assert writer(str(tmp_path / "missing")) == "templates"  # unreadable: the safe choice


def test_templated_probes_ask_about_every_fact_before_a_second_wording():
    from rlcli.data.probes import template_probes

    probes = template_probes(FACTS, 4)
    assert [p["check"] for p in probes] == ["Lisbon", "Nairobi", "Kyoto", "1987"]
    assert len({p["question"].split()[0] for p in probes}) == 1  # one wording each so far
    every = template_probes(FACTS, 100)
    assert len(every) == 4 * 6 + 1  # six wordings a fact, one continuation of the other
    assert every[-1]["question"].startswith("Continue this sentence")


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
    from rlcli.models.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", vocab_size=800)
    said = _error(cli("internalize", document, *common, "--teacher", other))
    assert f"--teacher {other}: its tokenizer differs from --model's" in said
    assert not run_dir.exists()


def test_a_server_without_the_model_is_refused_before_a_run_folder(server, document, tmp_path):
    from rlcli.models.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", vocab_size=800)
    run_dir = tmp_path / "run"
    result = cli("internalize", document, "--model", other, "--base-url", server.base_url,
                 "--log-path", run_dir)  # fmt: skip
    assert result.returncode == 1
    said = result.stderr.strip().splitlines()[-1]  # after the renderer and server lines
    assert said.startswith(f"error: --model {other}: the server at {server.base_url} serves")
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
        max_answer_tokens=4, targets="reference", question_writer="model",
    )  # fmt: skip
    outcome = rlcli.internalize(options, on_progress=events.append)
    receipt = outcome.summary["receipt"]
    assert receipt["scores"]["internalized"] is not None
    steps = [e for e in events if isinstance(e, rlcli.Step)]
    assert [s.step for s in steps] == [1, 2] and "loss" in steps[0].metrics
    said = [e.text for e in events if isinstance(e, rlcli.Message)]
    assert any("teacher writes questions" in t for t in said)
    assert any("teacher answers" in t for t in said)
    # The random tiny model writes no usable question: templated ones instead, and it says so.
    written = tmp_path / "run" / "written.jsonl"
    sources = {json.loads(line)["source"] for line in written.open()}
    assert receipt["questions"]["writer"] == "model" and sources <= {"model", "template"}
    assert ("template" in sources) == any("no usable question" in t for t in said)
    # Again on the same folder: it resumes, trains nothing more, and keeps the same adapter.
    mtime = written.stat().st_mtime_ns
    again = rlcli.internalize(options)
    assert again.plan.resuming and written.stat().st_mtime_ns == mtime  # not written again
    assert again.summary["sampler_path"] == outcome.summary["sampler_path"]
    # Another setting on the same folder is refused, naming it.
    with pytest.raises(rlcli.RlcliError, match="--top-k"):
        rlcli.internalize(InternalizeOptions(**{**options.__dict__, "top_k": 4}))


def test_runs_cancel_saves_the_adapter_and_a_rerun_resumes(server, tiny_model, document, tmp_path):
    """`runs cancel` mid-training saves a checkpoint and stops the run; the same command again
    resumes from it (the teacher is not asked again) and finishes."""
    import os
    import subprocess

    from conftest import RLCLI, wait_for_steps

    run_dir = tmp_path / "run"
    args = (
        "internalize", str(document), "--model", str(tiny_model), "--base-url",
        server.base_url, "--log-path", str(run_dir), "--n-questions", "12", "--epochs", "20",
        "--steps", "60", "--batch-size", "2", "--max-answer-tokens", "4", "--targets", "reference",
    )  # fmt: skip
    env = {"RLCLI_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([*RLCLI, *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    wait_for_steps(run_dir, 3, proc, timeout=300)  # loaded 2 cores: interpreter, imports, child
    cancelled = cli("runs", "cancel", str(run_dir), "--json", env=env)
    assert cancelled.returncode == 0, cancelled.stderr
    assert "/weights/" in json.loads(cancelled.stdout)["checkpoint"]["state_path"]
    proc.communicate(timeout=60)
    done = len(metrics.read_text().splitlines())
    last = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").open()][-1]
    assert last["cancelled"] and last["batch"] == done < 60
    targets = (run_dir / "targets.jsonl").stat().st_mtime_ns
    again = cli(*args, "--json", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.open()]
    assert steps == list(range(60))  # picked up where it stopped, each step once
    assert (run_dir / "targets.jsonl").stat().st_mtime_ns == targets  # not asked again
    assert json.loads(again.stdout)["sampler_path"].endswith("/sampler_weights/final")


@pytest.mark.slow
def test_smollm2_answers_from_the_adapter_what_it_never_read_in_context(tmp_path, smollm2_model):
    """Three made-up facts into SmolLM2's adapter from templated probes alone (reference
    targets: no teacher pass), then each asked as the benchmark asks it ("In what city does X
    live? Answer with the city only."), empty context, greedy."""
    import asyncio

    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    import rlcli
    from conftest import start_server
    from rlcli import InternalizeOptions
    from rlcli.client.context_distill import Renderer, answer
    from rlcli.compat.renderer_choice import resolve_renderer
    from rlcli.launch import process
    from rlcli.recipes.internalize_child import UNRELATED

    facts = [
        ("Zara Brandt", "lives in", "Bergen", "In what city does Zara Brandt live?"),
        ("Emil Haddad", "was born in", "1972", "In what year was Emil Haddad born?"),
        ("Bram Quill", "lives in", "Muscat", "In what city does Bram Quill live?"),
    ]
    filler = "The river rises in spring. Small shops open early on market days."
    text = " ".join([filler, *(f"{who} {verb} {what}." for who, verb, what, _ in facts), filler])
    document = tmp_path / "people.md"
    document.write_text(text + "\n")
    server_home = tmp_path / "server"
    record = start_server(server_home, smollm2_model, dtype="auto")  # bf16 here, as users get it
    try:
        outcome = rlcli.internalize(
            InternalizeOptions(
                documents=[str(document)],
                model=str(smollm2_model),
                base_url=record.base_url,
                log_path=str(tmp_path / "run"),
                n_questions=18,
                test_size=0.0,
                targets="reference",
                lr=3e-3,
                epochs=5,
                max_answer_tokens=16,
            )  # fmt: skip
        )
        name, _, _ = resolve_renderer(str(smollm2_model), None)
        render = Renderer(renderers.get_renderer(name, get_tokenizer(str(smollm2_model))))
        service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
        path = outcome.summary["sampler_path"]
        adapter = service.create_sampling_client(model_path=path).result()
        base = service.create_sampling_client(base_model=str(smollm2_model)).result()

        async def ask(client, question, context=None):
            return await answer(client, render, question, context, 16)

        async def all_answers():
            jobs = []
            for *_, question in facts:
                q = f"{question} Answer with the {'year' if 'year' in question else 'city'} only."
                jobs += [ask(base, q), ask(adapter, q), ask(base, q, UNRELATED)]
            return await asyncio.gather(*jobs)

        said = asyncio.run(all_answers())
    finally:
        process.stop(server_home)
    rows = [(fact[2], said[3 * i : 3 * i + 3]) for i, fact in enumerate(facts)]
    right = [[value.lower() in a.lower() for a in answers] for value, answers in rows]
    learned = [base_ok is False and adapted and control_ok is False
               for base_ok, adapted, control_ok in right]  # fmt: skip
    assert sum(learned) >= 2, rows  # the adapter knows what neither the base nor control says

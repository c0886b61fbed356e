"""Capture, feedback and ``rlcli traces`` against real servers: the agent loop of
test_tool_calls.py (through the official ``openai`` client) on conftest's ``tools_server``,
which captures; verdicts through ``POST /v1/feedback``; ``traces list|show|export`` read the
folder, and an SFT export trains through ``train sl``. Servers of their own for what ends a
server: kill -9 mid-stream (only whole lines stay), SIGTERM with ``--redact`` (nothing queued
is lost, nothing personal written), and a capture folder that cannot be used."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import FINAL, QUESTION, cli, start_server
from rlcli import trace_format
from test_tool_calls import agent_loop


def _records(folder: Path, ids: set[str], timeout: float = 60) -> dict[str, dict]:
    """The captured records of ``ids``, once the writer thread has written them all."""
    deadline = time.monotonic() + timeout
    while True:
        found = {r["id"]: r for r in trace_format.read(folder, trace_format.TRACES)}
        if ids <= set(found) or time.monotonic() > deadline:
            return {i: found[i] for i in ids if i in found}
        time.sleep(0.2)


@pytest.fixture(scope="module")
def client(tools_server):
    return openai.OpenAI(base_url=f"{tools_server.base_url}/v1", api_key="tml-dummy",
                         max_retries=0)  # fmt: skip


@pytest.fixture(scope="module")
def episode(client, tools_server, tool_user):
    """The agent loop with capture on: (messages, answers, the records of its exchanges)."""
    messages, answers = agent_loop(client, tool_user)
    ids = {a.id for a in answers}
    return messages, answers, _records(tools_server.capture, ids)


def test_every_exchange_of_an_agent_loop_is_one_line_with_what_an_rl_step_needs(
    episode, tool_user, tools_model
):
    from transformers import AutoTokenizer

    messages, answers, records = episode
    assert set(records) == {a.id for a in answers}
    call, final = records[answers[0].id], records[answers[1].id]
    assert call["model"] == call["checkpoint"] == tool_user  # the exact checkpoint answered
    assert call["endpoint"] == "chat.completions" and call["status"] == "ok"
    assert call["messages"] == QUESTION and call["tools"][0]["function"]["name"] == "get_weather"
    assert call["params"]["temperature"] == 0 and call["latency_s"] > 0
    (choice,) = call["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"] == [
        c.model_dump(exclude_none=True) for c in answers[0].choices[0].message.tool_calls
    ]
    tokenizer = AutoTokenizer.from_pretrained(tools_model)
    assert tokenizer.decode(choice["token_ids"]).startswith("<tool_call>")
    assert len(choice["logprobs"]) == len(choice["token_ids"])
    assert all(lp <= 0 for lp in choice["logprobs"])
    render = dict(tokenize=True, add_generation_prompt=True, return_dict=False)
    prompt = tokenizer.apply_chat_template(QUESTION, tools=call["tools"], **render)
    assert call["prompt_token_ids"] == [prompt]
    assert final["messages"][1:] == [
        {k: v for k, v in m.items() if v is not None} for m in messages[1:3]
    ]
    assert final["choices"][0]["message"] == {"role": "assistant", "content": FINAL}


def test_the_trace_id_header_and_a_streamed_exchange(client, tools_server, tools_model):
    raw = client.chat.completions.with_raw_response.create(
        model=str(tools_model), messages=QUESTION, max_tokens=5
    )
    assert raw.headers["x-rlcli-trace-id"] == raw.parse().id
    with httpx.stream("POST", f"{tools_server.base_url}/v1/chat/completions", json={
        "model": str(tools_model), "messages": QUESTION, "max_tokens": 6, "n": 2,
        "stream": True, "ignore_eos": True}) as response:  # fmt: skip
        trace_id = response.headers["x-rlcli-trace-id"]
        body = response.read().decode()
    assert f'"id": "{trace_id}"' in body and body.endswith("data: [DONE]\n\n")
    record = _records(tools_server.capture, {trace_id})[trace_id]
    assert record["status"] == "ok" and record["params"]["stream"] is True
    assert [len(c["token_ids"]) for c in record["choices"]] == [6, 6]


def _feedback(server, **body):
    return httpx.post(f"{server.base_url}/v1/feedback", json=body)


def test_feedback_several_per_trace_and_its_bad_inputs(episode, tools_server, keyed_server):
    _, answers, _ = episode
    call, final = answers[0].id, answers[1].id
    ok = [
        _feedback(tools_server, run_id=final, key="correctness", score=1, comment="right"),
        _feedback(tools_server, run_id=final, key="helpful", score=True, source="app"),
        _feedback(tools_server, run_id=call, key="correctness", score=0,
                  correction="It is 18C and sunny in Paris."),
    ]  # fmt: skip
    assert [r.status_code for r in ok] == [200, 200, 200], [r.text for r in ok]
    assert ok[1].json()["score"] == 1.0 and ok[0].json()["run_id"] == final
    bad = [
        ({"run_id": "chatcmpl-never", "key": "k", "score": 1}, 404, "run_id"),
        ({"run_id": final, "key": "k", "score": "high"}, 400, "score"),
        ({"run_id": final, "key": "k", "score": [1]}, 400, "score"),
        ({"run_id": final, "key": "", "score": 1}, 400, "key"),
        ({"run_id": final, "key": "k", "comment": "x" * (trace_format.MAX_COMMENT + 1)}, 400,
         "comment"),
        ({"run_id": final, "key": "k", "value": ["y" * 100] * 200}, 400, "value"),
        ({"key": "k"}, 400, "run_id"),
    ]  # fmt: skip
    for body, status, param in bad:
        response = _feedback(tools_server, **body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["param"] == param
    _, keyed = keyed_server  # behind the API key; a server without capture knows no trace
    assert _feedback(keyed, run_id=final, key="k").status_code == 401
    without = httpx.post(f"{keyed.base_url}/v1/feedback", json={"run_id": final, "key": "k"},
                         headers={"X-API-Key": "tml-secret"})  # fmt: skip
    assert without.status_code == 404 and "captures nothing" in without.json()["error"]["message"]
    lines = [v for v in trace_format.read(tools_server.capture, trace_format.FEEDBACK)]
    assert [(v["run_id"], v["key"]) for v in lines[-3:]] == [
        (final, "correctness"), (final, "helpful"), (call, "correctness"),
    ]  # fmt: skip


def test_traces_list_show_and_export_feed_train_sl(episode, tools_server, tools_model, tmp_path):
    _, answers, _ = episode
    folder = str(tools_server.capture)
    listed = json.loads(cli("traces", "list", "--dir", folder, "--json").stdout)
    assert {a.id for a in answers} <= {row["id"] for row in listed}
    scored = json.loads(cli("traces", "list", "--dir", folder, "--key", "correctness",
                            "--min-score", "1", "--json").stdout)  # fmt: skip
    assert [row["id"] for row in scored] == [answers[1].id]
    assert json.loads(cli("traces", "list", "--dir", folder, "--since", "1h", "--model",
                          "nope", "--json").stdout) == []  # fmt: skip
    shown = json.loads(cli("traces", "show", answers[0].id, "--dir", folder, "--json").stdout)
    assert shown["feedback"][0]["correction"] == "It is 18C and sunny in Paris."
    bad = cli("traces", "list", "--dir", folder, "--since", "yesterday")
    assert bad.returncode != 0 and "--since yesterday" in bad.stderr

    sft = tmp_path / "sft.jsonl"
    result = cli("traces", "export", "--as", "sft", "--dir", folder, "--key", "correctness",
                 "-o", str(sft))  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in sft.read_text().splitlines()]
    assert sorted(r["origin"]["kind"] for r in rows) == ["answer", "correction"]
    answer = next(r for r in rows if r["origin"]["kind"] == "answer")
    assert answer["messages"][-1] == {"role": "assistant", "content": FINAL}
    assert answer["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert answer["tools"][0]["function"]["name"] == "get_weather"
    dpo = cli("traces", "export", "--as", "dpo", "--dir", folder)
    (pair,) = [json.loads(line) for line in dpo.stdout.splitlines()]
    assert pair["chosen"][-1]["content"] == "It is 18C and sunny in Paris."
    assert pair["rejected"][-1]["content"] == ""  # the answer it corrected was a tool call
    prompts = cli("traces", "export", "--as", "prompts", "--dir", folder, "--key", "correctness")
    by_id = {r["id"]: r for r in map(json.loads, prompts.stdout.splitlines())}
    assert by_id[answers[1].id]["tool_outputs"] == ["18C, sunny in Paris"]
    assert by_id[answers[0].id]["answer"] == "It is 18C and sunny in Paris."
    assert by_id[answers[0].id]["question"] == "Weather in Paris?"
    judged = cli("traces", "export", "--as", "judged", "--dir", folder)
    by_trace = {r["origin"]["trace_id"]: r for r in map(json.loads, judged.stdout.splitlines())}
    assert set(by_trace) == {a.id for a in answers}  # every answer with a verdict
    assert by_trace[answers[0].id]["messages"][-1]["tool_calls"][0]["id"].startswith("call_")

    # `rlcli traces export --as sft | rlcli train sl --dataset -`, as imports are fed
    run = cli(
        "train", "sl", "--dataset", "-", "--model", str(tools_model),
        "--base-url", tools_server.base_url, "--log-path", str(tmp_path / "run"),
        "--batch-size", "2", "--max-steps", "2", "--json", stdin=sft.read_text(),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["state_path"].startswith("tinker://")


# ---- servers of their own: killed, stopped, refused --------------------------------------


def test_kill_9_mid_stream_leaves_only_whole_lines(tmp_path, tiny_model):
    """Also --capture-tinker: an SDK sample is a line of its own."""
    import tinker
    from tinker import types

    from rlcli.launch import pids

    home, folder = tmp_path / "home", tmp_path / "traces"
    record = start_server(home, tiny_model, capture=str(folder), capture_tinker=True)
    url = f"{record.base_url}/v1/chat/completions"
    body = {"model": str(tiny_model), "messages": QUESTION, "max_tokens": 4}
    done = [httpx.post(url, json=body, timeout=60).json()["id"] for _ in range(5)]
    service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    drawn = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2,
                           types.SamplingParams(max_tokens=3, seed=1)).result()  # fmt: skip
    assert len(_records(folder, set(done))) == 5
    samples: list[dict] = []
    deadline = time.monotonic() + 60
    while not samples and time.monotonic() < deadline:  # written once the engine answered
        samples = [
            r for r in trace_format.read(folder, "traces") if r["endpoint"] != "chat.completions"
        ]
        time.sleep(0.2)
    (sample,) = samples
    assert sample["endpoint"] == "tinker.sample"
    assert sample["prompt_token_ids"] == [[5, 6, 7]]
    assert [c["token_ids"] for c in sample["choices"]] == [s.tokens for s in drawn.sequences]
    started = threading.Event()

    def stream():
        try:
            with httpx.stream("POST", url, timeout=60, json={**body, "max_tokens": 2000,
                              "ignore_eos": True, "stream": True}) as response:  # fmt: skip
                for _ in response.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    assert started.wait(60)
    os.killpg(record.pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    pids.kill_group(record.pid, grace=0)
    files = trace_format.files(folder, trace_format.TRACES)
    data = b"".join(f.read_bytes() for f in files)
    lines = data.split(b"\n")
    assert lines[-1] in (b"",) or not files[-1].read_bytes().endswith(b"\n")
    whole = [json.loads(line) for line in lines[:-1]]  # every line with its newline is JSON
    assert {r["id"] for r in whole} >= set(done)


def test_sigterm_writes_every_queued_record_redacted(tmp_path, tiny_model):
    from rlcli.launch import process

    home, folder = tmp_path / "home", tmp_path / "traces"
    record = start_server(home, tiny_model, capture=str(folder), capture_redact=True)
    url = f"{record.base_url}/v1/chat/completions"
    asked = [{"role": "user", "content": "Mail ada@example.com or call +1 415 555 0100."}]
    ids: list[str] = []

    def ask():
        body = {"model": str(tiny_model), "messages": asked, "max_tokens": 3}
        ids.append(httpx.post(url, json=body, timeout=120).json()["id"])

    threads = [threading.Thread(target=ask) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    process.stop(home)  # SIGTERM: the app's shutdown drains the capture queue
    text = "".join(f.read_text() for f in trace_format.files(folder, trace_format.TRACES))
    rows = [json.loads(line) for line in text.splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(ids) and len(ids) == 12
    assert "ada@example.com" not in text and "415 555 0100" not in text
    assert rows[0]["messages"][0]["content"] == "Mail <EMAIL_1> or call <PHONE_1>."
    assert "prompt_token_ids" not in rows[0] and "token_ids" not in rows[0]["choices"][0]
    assert rows[0]["redacted"]["replaced"] == {"EMAIL": 1, "PHONE": 1}


def test_a_capture_folder_that_cannot_be_used_is_one_line_at_start(tmp_path, tiny_model,
                                                                    monkeypatch):  # fmt: skip
    from rlcli.demo.run import free_port
    from rlcli.server.state import capture

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = cli(
        "serve", "start", "--base-model", str(tiny_model), "--port", str(free_port()),
        "--capture-dir", str(blocker / "traces"), env={"RLCLI_HOME": str(tmp_path / "home")},
    )  # fmt: skip
    assert result.returncode != 0
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "--capture" in error and "cannot create the folder (Not a directory)" in error
    monkeypatch.setattr(capture, "MIN_FREE_BYTES", 1 << 62)
    with pytest.raises(capture.CaptureError, match="the disk is full or nearly"):
        capture.Capture(tmp_path / "full")
    refused = cli("serve", "start", "--base-model", str(tiny_model), "--redact")
    assert refused.returncode != 0 and "--redact: only with --capture" in refused.stderr


def test_a_restarted_server_knows_the_traces_already_in_its_folder(tmp_path):
    """Feedback for a trace captured before a restart: found in the files, not in memory."""
    from rlcli.server.state.capture import Capture

    first = Capture(tmp_path)
    first.trace({"v": trace_format.VERSION, "id": "chatcmpl-old", "messages": [
        {"role": "user", "content": 'a "id": "chatcmpl-inner", inside'}]})  # fmt: skip
    first.close()
    again = Capture(tmp_path)
    assert again.has_trace("chatcmpl-old") and not again.has_trace("chatcmpl-inner")
    again.add_feedback({"v": 1, "run_id": "chatcmpl-old", "key": "k"})
    again.close()
    assert len(trace_format.files(tmp_path, "traces")) == 2  # a new file per start
    assert [v["run_id"] for v in trace_format.read(tmp_path, "feedback")] == ["chatcmpl-old"]

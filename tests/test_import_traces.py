"""`rlcli import -f langsmith|langfuse|otel`: golden files written from each platform's schemas
(tests/data/imports/README.md says which), malformed files, and the pipe into `train sl`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli
from rlcli.data.importers import ImportReport, import_lines
from rlcli.data.trace_imports import RECORDS
from rlcli.data.trace_imports.assemble import Call, Collected, ToolRun, Verdict, assemble
from rlcli.data.trace_imports.shaping import FEEDBACK_FIELDS

DATA = Path(__file__).parent / "data" / "imports"
DEAD_URL = "http://127.0.0.1:9"

GOLDEN = [
    ("langsmith", "openai_agent", "read 11, wrote 2, not mapped: 1 choice beyond the first; "
     "1 feedback on a trace with no LLM call in the input; 1 retriever run"),
    ("langsmith", "langchain_nested", "read 4, wrote 2, not mapped: 1 LLM call with no answer "
     "recorded"),
    ("langfuse", "traces_full", "read 2, wrote 2, not mapped: 1 RETRIEVER observation; "
     "1 choice beyond the first; 1 image_url content part"),
    ("langfuse", "observations_scores", "read 9, wrote 1, not mapped: 1 EVENT observation; "
     "1 score on a session, not a trace; 1 trace with no GENERATION observation"),
    ("otel", "genai_spans", "read 2, wrote 1, not mapped: 1 evaluation that failed "
     "(error.type); 1 reasoning message part"),
    ("otel", "genai_events", "read 2, wrote 1, not mapped: 1 LLM span with no recorded content "
     "(content capture off?); 1 choice beyond the first; 1 embeddings span; 1 message event "
     "with no content (content capture off?)"),
    ("otel", "openinference", "read 1, wrote 1, not mapped: 1 RETRIEVER span"),
]  # fmt: skip


def _rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize(("fmt", "name", "summary"), GOLDEN, ids=[g[1] for g in GOLDEN])
def test_golden_files_import_as_expected(fmt, name, summary):
    source = DATA / fmt / f"{name}.jsonl"
    result = cli("import", source, "-f", fmt, "--min-messages", "1")
    assert result.returncode == 0, result.stderr
    assert _rows(result.stdout) == _rows((DATA / fmt / f"{name}.expected.jsonl").read_text())
    assert result.stderr.splitlines() == [f"{source}: {summary}"]


def test_rows_are_what_traces_export_writes_and_train_sl_reads():
    """Messages with text content (never null), tool calls in the chat API's shape, feedback
    with LangSmith's six field names; every golden row passes `train sl`'s own validation."""
    from rlcli.data.chat import check_conversation

    for fmt, name, _ in GOLDEN:
        for row in _rows((DATA / fmt / f"{name}.expected.jsonl").read_text()):
            assert check_conversation(row) is None, (name, row)
            assert set(row) <= {"messages", "tools", "feedback", "origin"}
            assert row["origin"]["format"] == fmt
            assert all(tuple(entry) == FEEDBACK_FIELDS for entry in row["feedback"])
            for m in row["messages"]:
                assert isinstance(m["content"], str)
                for call in m.get("tool_calls", ()):
                    assert call["type"] == "function"
                    json.loads(call["function"]["arguments"])


def test_an_agent_loop_is_one_row_with_its_verdicts():
    """LangSmith: the two calls of one agent loop fold into one row; feedback on the root run
    and on the answering call both land on it; trace 2's feedback on trace 2's row."""
    rows = _rows((DATA / "langsmith" / "openai_agent.expected.jsonl").read_text())
    agent, rag = rows
    assert [m["role"] for m in agent["messages"]] == [
        "system", "user", "assistant", "tool", "assistant"
    ]  # fmt: skip
    assert agent["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert agent["tools"][0]["function"]["name"] == "get_weather"
    assert [f["key"] for f in agent["feedback"]] == ["user_score", "correctness"]
    assert agent["feedback"][1]["correction"] == {
        "outputs": {"content": "It is 18C (64F) and sunny in Paris."}
    }
    assert [f["key"] for f in rag["feedback"]] == ["conciseness"]


MALFORMED = [
    ("langsmith", {"run_type": "llm", "name": "x"}, "id: missing"),
    ("langsmith", {"id": "r", "run_type": "llm", "inputs": {"messages": [{"role": "wizard"}]}},
     "inputs.messages[0].role: unknown role 'wizard'"),
    ("langsmith", {"id": "r", "run_type": "llm", "inputs": {"messages": []},
                   "outputs": {"choices": [{"message": "hi"}]}},
     "outputs.choices[0].message: not an object"),
    ("langsmith", {"id": "f", "run_id": "r", "key": "k", "score": "high"},
     "score: 'high' is not a number"),
    ("langsmith", {"id": "r", "run_type": "chain", "child_runs": [{"id": "c", "run_type": "llm",
                   "inputs": {"prompts": [3]}}]},
     "child_runs[0].inputs.prompts: not a list of strings"),
    ("langsmith", {"hello": 1}, "neither a run (run_type) nor "
     "feedback (key and run_id)"),
    ("langfuse", {"type": "GENERATION", "traceId": "t", "id": "g", "input": 5},
     "input: a GENERATION needs messages"),
    ("langfuse", {"id": "t", "observations": [{"id": "g", "type": "GENERATION",
                  "input": [{"role": "user", "content": 7}]}]},
     "observations[0].input[0].content: content of type int is "
     "not text"),
    ("langfuse", {"name": "s", "dataType": "NUMERIC", "value": "x", "traceId": "t",
                  "source": "API"},
     "value: 'x' is not a number (NUMERIC score)"),
    ("otel", {"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": "a"}]}]}]},
     "resourceSpans[0].scopeSpans[0].spans[0].traceId: missing"),
    ("otel", {"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "t", "spanId": "s",
              "attributes": [{"key": "gen_ai.input.messages",
                              "value": {"stringValue": "[{"}}]}]}]}]},
     "resourceSpans[0].scopeSpans[0].spans[0].attributes"
     "[gen_ai.input.messages]: a string that is not JSON"),
    ("otel", {"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "t", "spanId": "s",
              "attributes": [{"key": "gen_ai.input.messages", "value": {"stringValue":
              '[{"role": "user", "content": "hi"}]'}}]}]}]}]},
     "gen_ai.input.messages][0].parts: missing (a GenAI message is {role, parts})"),
    ("otel", {"resourceLogs": [{"scopeLogs": [{"logRecords": [{"eventName":
              "gen_ai.evaluation.result", "attributes": []}]}]}]},
     "resourceLogs[0].scopeLogs[0].logRecords[0].attributes[gen_ai.evaluation.name]: missing"),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "bad", "message"), MALFORMED)
def test_a_malformed_line_is_one_line_naming_file_line_and_field(tmp_path, fmt, bad, message):
    """The good lines around it still import; the bad one is one stderr line; --strict makes it
    fatal with nothing written."""
    good = (DATA / fmt / GOLDEN_FILE[fmt]).read_text().splitlines()[0]
    dump = tmp_path / "dump.jsonl"
    dump.write_text("\n".join([good, json.dumps(bad), "{oops"]) + "\n")
    result = cli("import", dump, "-f", fmt, "--min-messages", "1")
    assert result.returncode == 0, result.stderr
    errors = [line for line in result.stderr.splitlines() if ": line " in line]
    assert len(errors) == 2, errors
    assert errors[0].startswith(f"{dump}: line 2: not {RECORDS[fmt]}: ") and message in errors[0]
    assert errors[1].startswith(f"{dump}: line 3: not JSON (")
    assert len(_rows(result.stdout)) == 1
    out = tmp_path / "out.jsonl"
    strict = cli("import", dump, "-f", fmt, "--strict", "-o", out)
    assert strict.returncode == 1 and "2 bad lines (--strict); nothing written" in strict.stderr
    assert not out.exists()


GOLDEN_FILE = {"langsmith": "langchain_nested.jsonl", "langfuse": "traces_full.jsonl",
               "otel": "openinference.jsonl"}  # fmt: skip


def test_a_bad_line_leaves_nothing_behind():
    """A run whose nested child is malformed is not half-read: its own LLM call is not kept."""
    good_call = {
        "id": "r1",
        "run_type": "llm",
        "inputs": {"messages": [{"role": "user", "content": "hi"}]},
        "outputs": {"choices": [{"message": {"role": "assistant", "content": "hello"}}]},
        "child_runs": [{"id": "c1", "run_type": "llm"}],
    }
    report = ImportReport()
    rows = list(import_lines([json.dumps(good_call)], "langsmith", report=report))
    assert rows == [] and report.written == 0
    assert "child_runs[0].inputs: not an object" in report.errors[0].message


def test_import_pipes_into_train_sl(tiny_model):
    """`rlcli import -f langsmith ... | rlcli train sl --dataset - --dry-run` takes the rows."""
    imported = cli("import", DATA / "langsmith" / "openai_agent.jsonl", "-f", "langsmith")
    assert imported.returncode == 0, imported.stderr
    plan = cli(
        "train", "sl", "--dataset", "-", "--model", tiny_model, "--base-url", DEAD_URL,
        "--dry-run", "--json", "--test-size", "0", "--batch-size", "1",
        stdin=imported.stdout,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["examples"] == 2


def _call(trace, cid, t, messages, answer, tools=()):
    return Call(trace, cid, (t,), messages, {"role": "assistant", "content": answer},
                list(tools))  # fmt: skip


def test_unrelated_calls_of_one_trace_are_rows_of_their_own_and_verdicts_follow_them():
    user = {"role": "user", "content": "summarise"}
    other = {"role": "user", "content": "translate"}
    found = Collected(
        calls=[_call("t", "a", 1, [user], "short"), _call("t", "b", 2, [other], "kurz")],
        verdicts=[
            Verdict("t", "a", {"key": "on_a"}),
            Verdict(None, "root", {"key": "on_trace"}),
            Verdict("t", None, {"key": "trace_only"}),
        ],  # fmt: skip
        owners={"root": "t"},
    )
    rows = list(assemble(found))
    assert [r[2] for r in rows] == ["a", "b"]
    assert [f["key"] for f in rows[0][0]["feedback"]] == ["on_a", "on_trace", "trace_only"]
    assert [f["key"] for f in rows[1][0]["feedback"]] == ["on_trace", "trace_only"]


def test_an_unanswered_tool_call_is_answered_from_the_tool_run_by_id_then_by_name():
    """A trace that ends on the model's tool calls: the tool runs answer them (by call id,
    else by tool name); a tool run nothing called is counted, not dropped silently."""
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    asked = {"role": "user", "content": "go"}
    runs = [ToolRun("t", "r-g", (1,), "g", None, "G out"),
            ToolRun("t", "r-f", (2,), "f", "c1", "F out"),
            ToolRun("t", "r-x", (3,), "x", None, "never called")]  # fmt: skip
    answer = {"role": "assistant", "content": "", "tool_calls": calls}
    broken = Call("t", "z", (9,), [{"role": "user", "content": "again"}], None)
    found = Collected(calls=[Call("t", "a", (0,), [asked], answer), broken], tool_runs=runs)
    ((row, trace, call),) = assemble(found)
    assert (trace, call) == ("t", "a")
    assert [(m["role"], m["content"], m.get("tool_call_id")) for m in row["messages"][2:]] == [
        ("tool", "F out", "c1"), ("tool", "G out", "c2")
    ]  # fmt: skip
    assert found.unmapped == {"LLM call with no answer recorded": 1,
                              "tool run matched to no tool call": 1}  # fmt: skip


def _otlp_span(span_id, attributes, events=(), trace="ab" * 16):
    def value(v):
        return {"stringValue": v} if isinstance(v, str) else {"intValue": str(v)}

    def attrs(d):
        return [{"key": k, "value": value(v)} for k, v in d.items()]

    return {
        "traceId": trace, "spanId": span_id, "name": "chat", "startTimeUnixNano": "1",
        "attributes": attrs(attributes),
        "events": [{"name": n, "timeUnixNano": str(i), "attributes": attrs(a)}
                   for i, (n, a) in enumerate(events)],
    }  # fmt: skip


def test_otel_span_events_and_the_details_event_carry_conversations_too():
    """Three more places a conversation sits: message events as span events (attributes for a
    body), the oldest gen_ai.content.prompt/completion events, and the
    gen_ai.client.inference.operation.details event (the semconv attributes on a log record)."""
    as_events = _otlp_span("s1", {"gen_ai.operation.name": "chat"}, [
        ("gen_ai.user.message", {"content": "ping"}),
        ("gen_ai.choice", {"index": 0, "finish_reason": "stop"}),  # body fields as attributes
    ])  # fmt: skip
    as_events["events"][1]["attributes"].append(
        {"key": "message", "value": {"kvlistValue": {"values": [
            {"key": "content", "value": {"stringValue": "pong"}}]}}}
    )  # fmt: skip
    prompt = json.dumps([{"role": "user", "content": "2+2?"}])
    completion = json.dumps([{"role": "assistant", "content": "4"}])
    oldest = _otlp_span(
        "s2",
        {"gen_ai.system": "openai"},
        [("gen_ai.content.prompt", {"gen_ai.prompt": prompt}),
         ("gen_ai.content.completion", {"gen_ai.completion": completion})],
        trace="cd" * 16,
    )  # fmt: skip
    said = [("user", "hi"), ("assistant", "hello")]
    parts = {
        key: [{"role": who, "parts": [{"type": "text", "content": text}]}]
        for key, (who, text) in zip(
            ("gen_ai.input.messages", "gen_ai.output.messages"), said, strict=True
        )
    }
    details = {
        "eventName": "gen_ai.client.inference.operation.details",
        "traceId": "ef" * 16,
        "spanId": "s3",
        "timeUnixNano": "5",
        "attributes": [
            {"key": k, "value": {"stringValue": json.dumps(v)}} for k, v in parts.items()
        ],
    }
    lines = [
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [as_events, oldest,
            _otlp_span("s3", {"gen_ai.operation.name": "chat"}, trace="ef" * 16)]}]}]}),
        json.dumps({"resourceLogs": [{"scopeLogs": [{"logRecords": [details]}]}]}),
    ]  # fmt: skip
    report = ImportReport()
    rows = list(import_lines(lines, "otel", report=report))
    assert report.errors == [] and not report.unmapped
    assert [[(m["role"], m["content"]) for m in r["messages"]] for r in rows] == [
        [("user", "ping"), ("assistant", "pong")],
        [("user", "2+2?"), ("assistant", "4")],
        [("user", "hi"), ("assistant", "hello")],
    ]

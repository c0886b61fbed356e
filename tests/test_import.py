"""`rlcli import`: realistic dumps of each format, and every bad-input case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli
from rlcli.data.chat import DataError, read_conversations
from rlcli.data.importers import ImportReport, import_lines

OPENAI = [
    {  # request/response log with multi-part content and a system prompt
        "request": {
            "model": "gpt-4o",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in "},
                        {"type": "image_url", "image_url": {"url": "data:..."}},
                        {"type": "text", "text": "this picture?"},
                    ],
                },
            ],
        },
        "response": {"choices": [{"message": {"role": "assistant", "content": "A cat."}}]},
    },
    {  # a tool-call round trip, then the final answer
        "request": {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
            ]
        },
        "response": {"choices": [{"message": {"role": "assistant", "content": "18C and sunny."}}]},
    },
    {  # batch-API layout
        "custom_id": "r1",
        "body": {"messages": [{"role": "user", "content": "2+2?"}]},
        "response": {"body": {"choices": [{"message": {"role": "assistant", "content": "4"}}]}},
    },
    {"request": {"messages": [{"role": "user", "content": "no answer was logged"}]}},
]

ANTHROPIC = [
    {
        "request": {
            "model": "claude-sonnet",
            "system": [{"type": "text", "text": "Answer in French."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
                {"role": "assistant", "content": "Bonjour"},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                        {"type": "text", "text": "Merci?"},
                    ],
                },
            ],
        },
        "response": {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "..."},
                {"type": "text", "text": "De rien."},
            ],
        },
    },
    {"system": "Be kind.", "messages": [{"role": "user", "content": "Hi"}], "content": []},
]

SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "You help."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
        ]
    }
]

MESSAGES = [
    {
        "messages": [
            {"role": "human", "content": "Ping"},
            {"role": "ai", "content": "Pong"},
            {"role": "user", "content": "Again"},
            {"role": "model", "content": "Pong"},
            {"role": "bot", "content": "(done)"},
        ]
    }
]


def _run(rows, fmt, **kwargs):
    report = ImportReport()
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    return list(import_lines(lines, fmt, report=report, **kwargs)), report


def test_openai_dumps_keep_system_flatten_parts_and_drop_tool_turns():
    out, report = _run(OPENAI, "openai")
    assert report.read == 4 and report.written == 3
    assert report.skipped == {"no assistant turn": 1}
    first = out[0]["messages"]
    assert first == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is in this picture?"},
        {"role": "assistant", "content": "A cat."},
    ]
    assert [m["role"] for m in out[1]["messages"]] == ["user", "assistant"]
    assert out[2]["messages"][-1] == {"role": "assistant", "content": "4"}


def test_openai_keep_tools_keeps_calls_and_results_as_text():
    out, _ = _run(OPENAI[1:2], "openai", keep_tools=True)
    roles = [m["role"] for m in out[0]["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert '"name": "weather"' in out[0]["messages"][1]["content"]
    assert out[0]["messages"][2]["content"] == "18C, sunny"


def test_anthropic_dumps_keep_system_and_flatten_blocks():
    out, report = _run(ANTHROPIC, "anthropic")
    assert report.written == 1 and report.skipped == {"no assistant turn": 1}
    messages = out[0]["messages"]
    assert messages[0] == {"role": "system", "content": "Answer in French."}
    assert messages[3] == {"role": "user", "content": "Merci?"}  # tool_result dropped
    assert messages[-1] == {"role": "assistant", "content": "De rien."}  # thinking dropped


def test_sharegpt_and_messages_normalize_roles():
    out, _ = _run(SHAREGPT, "sharegpt")
    assert [m["role"] for m in out[0]["messages"]] == ["system", "user", "assistant"]
    out, _ = _run(MESSAGES, "messages")
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant"] * 2 + ["assistant"]


def test_min_messages_and_limit():
    out, report = _run(OPENAI, "openai", min_messages=3)
    assert report.written == 1 and report.skipped["under 3 messages"] == 2
    out, report = _run(OPENAI, "openai", limit=1)
    assert len(out) == 1


def test_bad_lines_are_reported_by_number():
    rows = [OPENAI[0], "{not json", [1, 2], {"conversations": "x"}, {"messages": 5}]
    _, report = _run(rows, "openai")
    assert [e.line for e in report.errors] == [2, 3, 4, 5]
    assert "not JSON" in report.errors[0].message
    assert "expected a JSON object" in report.errors[1].message
    assert 'no request "messages" list' in report.errors[2].message
    _, report = _run([{"conversations": [{"from": "alien", "value": "x"}]}], "sharegpt")
    assert "unknown role 'alien'" in report.errors[0].message


def test_cli_reports_counts_on_stderr_and_jsonl_on_stdout(tmp_path):
    dump = tmp_path / "dump.jsonl"
    dump.write_text("\n".join(json.dumps(r) for r in OPENAI) + "\n{bad\n")
    result = cli("import", str(dump), "-f", "openai")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 3 and all("messages" in r for r in rows)
    assert "line 5: not JSON" in result.stderr
    assert "read 5, wrote 3, skipped 1 (no assistant turn), 1 bad lines" in result.stderr


def test_cli_strict_writes_nothing_when_a_line_is_bad(tmp_path):
    dump = tmp_path / "dump.jsonl"
    dump.write_text(json.dumps(OPENAI[0]) + "\n{bad\n")
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    result = cli("import", str(dump), "-f", "openai", "--strict", "-o", str(out))
    assert result.returncode == 1
    assert "1 bad lines (--strict); nothing written" in result.stderr
    assert out.read_text() == "precious\n"


def test_cli_unknown_format_and_missing_file(tmp_path):
    result = cli("import", str(tmp_path / "nope.jsonl"), "-f", "openai")
    assert result.returncode == 1 and "nope.jsonl: no such file" in result.stderr
    result = cli("import", "-", "-f", "csv", stdin="")
    assert result.returncode == 1 and "--format csv: unknown format" in result.stderr


def _dump(tmp_path, rows, name="dump.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("rows", "given", "fits"),
    [(OPENAI, "anthropic", "openai"), (OPENAI, "sharegpt", "openai"),
     (ANTHROPIC, "openai", "anthropic"), (SHAREGPT, "messages", "sharegpt"),
     (MESSAGES, "sharegpt", "messages")],
)  # fmt: skip
def test_a_format_that_does_not_fit_is_refused_naming_the_one_that_does(
    rows, given, fits, tmp_path
):
    """`-f anthropic` on an OpenAI dump would drop every row as "no assistant turn"; `-f openai`
    on an Anthropic dump would lose the system prompt and the final answer: neither is written."""
    dump, out = _dump(tmp_path, rows), tmp_path / "out.jsonl"
    out.write_text("precious\n")
    result = cli("import", str(dump), "-f", given, "-o", str(out))
    assert result.returncode == 1 and out.read_text() == "precious\n"
    assert result.stderr.startswith(f"error: {dump}: this does not look like -f {given}: ")
    assert result.stderr.strip().endswith(f"pass -f {fits} (or -f auto)")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("rows", "fmt"),
    [(OPENAI, "openai"), (ANTHROPIC, "anthropic"), (SHAREGPT, "sharegpt"),
     (MESSAGES, "messages")],
)  # fmt: skip
def test_auto_picks_the_format_and_reads_as_it_would(rows, fmt, tmp_path):
    dump = _dump(tmp_path, rows)
    given = cli("import", str(dump), "-f", fmt)
    auto = cli("import", str(dump))  # -f auto is the default
    assert given.returncode == auto.returncode == 0, auto.stderr
    assert auto.stdout == given.stdout
    assert auto.stderr.startswith(f"{dump}: format {fmt} (-f auto: it keeps ")


def test_auto_picks_each_trace_format(tmp_path):
    data = Path(__file__).parent / "data" / "imports"
    for fmt in ("langsmith", "langfuse", "otel"):
        for source in sorted((data / fmt).glob("*.jsonl")):
            if source.name.endswith(".expected.jsonl"):  # rlcli's own rows: messages
                continue
            auto = cli("import", str(source), "--min-messages", "1")
            given = cli("import", str(source), "-f", fmt, "--min-messages", "1")
            assert auto.returncode == 0 and auto.stdout == given.stdout, (source, auto.stderr)
            assert f"format {fmt} (-f auto" in auto.stderr


def test_auto_with_nothing_it_can_read_is_one_line(tmp_path):
    dump = tmp_path / "notes.jsonl"
    dump.write_text('{"note": "hello"}\n{"note": "bye"}\n')
    result = cli("import", str(dump))
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: {dump}: -f auto: no format finds a conversation")


def test_strict_says_nothing_was_written_and_never_wrote(tmp_path):
    dump = tmp_path / "dump.jsonl"
    dump.write_text(json.dumps(OPENAI[0]) + "\n{bad\n")
    result = cli("import", str(dump), "-f", "openai", "--strict", "-o", str(tmp_path / "o.jsonl"))
    assert result.returncode == 1 and not (tmp_path / "o.jsonl").exists()
    assert "wrote" not in result.stderr
    assert f"{dump}: read 2, 1 usable, none written, 1 bad lines" in result.stderr


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("{oops", "not JSON"),
        ('{"text": "hi"}', 'no "messages" field (keys: text)'),
        ('{"messages": []}', "empty conversation"),
        ('{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0]: unknown role"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
        ('{"messages": [{"role": "user", "content": 5}]}', "messages[0]: content is not text"),
        ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null, '
         '"tool_calls": [{"function": {"arguments": "{}"}}]}]}',
         "messages[1]: tool_calls must be an assistant's list of function calls"),
        ('{"tools": [{"type": "function"}], "messages": [{"role": "user", "content": "x"}]}',
         '"tools" is not a list of function'),
    ],
)  # fmt: skip
def test_training_data_validation_names_the_line(line, fragment):
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    good = json.dumps({"messages": turns})
    with pytest.raises(DataError) as excinfo:
        read_conversations([good, line, good], "data.jsonl")
    message = str(excinfo.value)
    assert "data.jsonl: 1 of 3 lines" in message and f"line 2: {fragment}" in message


def test_tool_calls_tool_results_and_tools_are_kept_for_training():
    call = {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    row = {"tools": [{"type": "function", "function": {"name": "f"}}], "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]}  # fmt: skip
    (kept,) = read_conversations([json.dumps(row)], "data.jsonl")
    assert kept["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}  # fmt: skip
    assert kept["messages"][2]["tool_call_id"] == "c1"
    assert kept["tools"] == [{"name": "f", "description": "",
                              "parameters": {"type": "object", "properties": {}}}]  # fmt: skip

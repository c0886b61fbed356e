"""Tool calling at ``/v1/chat/completions``: the parsers on their own, then the official
``openai`` client against a real server of the tiny model with a Hermes/Qwen-style chat
template (``rlcli models tiny --tools``).

The server (conftest's ``tools_server``, shared with test_traces.py) captures what it serves.
How the end-to-end tests stay honest: an untrained tiny model never writes a tool call, so a
LoRA is first taught, through the unmodified Tinker SDK, on tokens rendered by the model's own
chat template (the one the server renders with): to answer the weather question with a
``<tool_call>`` block, and, once the tool's output is in the history, with a sentence. Every
tool call below is then what the server's sampler drew for that LoRA, read back by the Hermes
parser on the same path any model's answer takes; nothing is canned.
"""

from __future__ import annotations

import json

import openai
import pytest

from conftest import CALL, FINAL, QUESTION, WEATHER, cli, get_weather
from rlcli.server.http.openai.tool_parsers import PARSERS, ToolText, for_template

# ---- parsers ----------------------------------------------------------------------------


def _streamed(parser_name: str, text: str, prefix: str = "") -> tuple[str, list]:
    """Feed ``text`` one character at a time, as a stream would."""
    tools, content, calls = ToolText(PARSERS[parser_name](), prefix), "", []
    for i, ch in enumerate(text):
        piece, new = tools.push(ch, final=i == len(text) - 1)
        content, calls = content + piece, calls + new
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "parser, text, content, calls",
    [
        ("hermes", "Let me look.\n" + CALL, "Let me look.\n", [("get_weather", {"city": "Paris"})]),
        ("hermes", CALL + "\n" + CALL.replace("Paris", "Oslo"), "",
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
        ("hermes", "a <tool_call> that never parses", "a <tool_call> that never parses", []),
        ("hermes", "<tool_call>\n" + '{"name": "f", "arguments": {}}', "", [("f", {})]),  # unclosed
        ("hermes", "x < y and <tool_ is text", "x < y and <tool_ is text", []),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", '
         '"parameters": {}}', "", [("f", {"a": 1}), ("g", {})]),
        ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
        ("llama3_json", "Plain answer.", "Plain answer.", []),
        ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": "b"}}]', "Sure. ",
         [("f", {"a": "b"})]),
    ],
)  # fmt: skip
def test_parsers_read_calls_streamed_a_character_at_a_time(parser, text, content, calls):
    assert _streamed(parser, text) == (content, calls)
    whole = ToolText(PARSERS[parser]())
    got_content, got_calls = whole.push(text, final=True)
    assert (got_content, [(c.name, json.loads(c.arguments)) for c in got_calls]) == (content, calls)


def test_forced_prefixes_complete_into_calls():
    for name, parser in PARSERS.items():
        prefix = parser().forced("f")
        tail = {"hermes": '{"a": 1}}\n</tool_call>', "llama3_json": '{"a": 1}}',
                "mistral": '{"a": 1}}]'}[name]  # fmt: skip
        assert _streamed(name, tail, prefix) == ("", [("f", {"a": 1})]), name


def test_templates_pick_their_family():
    from rlcli.models.tiny import CHATML_TEMPLATE, TOOLS_TEMPLATE

    assert for_template(TOOLS_TEMPLATE).name == "hermes"
    assert for_template("... [TOOL_CALLS] ... <tool_call>").name == "mistral"
    assert for_template('{"name": function name, "parameters": ...}<|eot_id|>').name == (
        "llama3_json"
    )
    assert for_template(CHATML_TEMPLATE) is None


# ---- the served model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tools_server):
    return openai.OpenAI(base_url=f"{tools_server.base_url}/v1", api_key="tml-dummy",
                         max_retries=0)  # fmt: skip


def agent_loop(client, model: str, **extra) -> tuple[list[dict], list]:
    """The plain agent loop of OpenAI's docs: call the model, run the tools it asks for, send
    their outputs back, until it answers in words."""
    functions = {"get_weather": get_weather}
    messages, answers = list(QUESTION), []
    for _ in range(4):
        answer = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=120, **extra
        )
        answers.append(answer)
        choice = answer.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            return messages, answers
        for call in choice.message.tool_calls:
            output = functions[call.function.name](**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    raise AssertionError(f"no answer in words after 4 turns: {messages}")


def test_an_agent_loop_calls_a_local_function_through_the_openai_client(client, tool_user):
    messages, answers = agent_loop(client, tool_user)
    first = answers[0].choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.content is None
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"},
    )  # fmt: skip
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": call.id,
        "content": "18C, sunny in Paris",
    }
    assert messages[-1]["content"] == FINAL and answers[-1].choices[0].finish_reason == "stop"
    assert len(answers) == 2


def test_a_streamed_tool_call_equals_the_whole_one(client, tool_user):
    kwargs = dict(model=tool_user, messages=QUESTION, tools=[WEATHER], temperature=0,
                  max_tokens=120)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, content, reasons = {}, "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                got = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                got["name"] += delta.function.name or ""
                got["arguments"] += delta.function.arguments or ""
    assert content == "" and [r for r in reasons if r] == ["tool_calls"]
    (call,) = whole.message.tool_calls
    assert list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == (
        call.function.name,
        call.function.arguments,
    )


def test_tool_choice_none_named_and_required(client, tool_user):
    """``none``: the tools are not rendered and nothing is read as a call; a named function and
    ``required`` start the answer with a call (the prompt ends with its opening), and the model
    completes it."""
    base = dict(model=tool_user, messages=QUESTION, tools=[WEATHER], temperature=0, max_tokens=120)
    none = client.chat.completions.create(**base, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        answer = client.chat.completions.create(**base, tool_choice=choice).choices[0]
        assert answer.finish_reason == "tool_calls", choice
        (call,) = answer.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "Paris"},
        )  # fmt: skip


def test_tool_fields_a_request_gets_wrong_are_400s_naming_them(client, tools_model):
    model = str(tools_model)
    bad = [
        ({"tool_choice": "auto"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
         "tools.0.function.name"),
        ({"tools": [WEATHER], "messages": [*QUESTION, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]  # fmt: skip
    for extra, param in bad:
        body = {"messages": QUESTION, "max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, **body)
        assert e.value.body["param"] == param, (extra, e.value.body)
    # the server keeps serving
    assert client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2).choices


def test_a_template_without_tools_refuses_them_naming_the_field(server, tiny_model):
    """The plain tiny model's ChatML template (like SmolLM2's) renders no tools."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="tml-dummy", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=str(tiny_model), messages=QUESTION, tools=[WEATHER])
    assert e.value.body["param"] == "tools" and "no tool support" in e.value.body["message"]
    history = [*QUESTION, {"role": "tool", "tool_call_id": "c", "content": "18C"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=str(tiny_model), messages=history)
    assert e.value.body["param"] == "messages[1].role"
    models = client.models.list().data
    assert models[0].model_extra["chat_template"]["tool_parser"] is None


def test_train_sl_on_a_file_of_tool_calls_teaches_the_served_model_to_call(
    client, tools_server, tools_model, tmp_path
):
    """What ``rlcli traces export --as sft`` writes (OpenAI's format: calls with their
    arguments as a string, the tool's result, the tools offered), trained from a file with
    ``train sl``: the served LoRA then calls the tool; the base model does not."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    row = {
        "tools": [WEATHER],
        "messages": [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": get_weather("Paris")},
                     {"role": "assistant", "content": FINAL}],
    }  # fmt: skip
    plain = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi."}]
    }
    data = tmp_path / "sft.jsonl"  # one row without calls: a table would give it tool_calls None
    data.write_text("".join(json.dumps(r) + "\n" for r in [row] * 7 + [plain]))
    args = ("train", "sl", "--model", str(tools_model), "--dataset", str(data), "--base-url",
            tools_server.base_url, "--log-path", str(tmp_path / "run"), "--batch-size", "4",
            "--epochs", "30", "--lr", "5e-3", "--lr-schedule", "constant", "--lora-rank", "16",
            "--json")  # fmt: skip
    plan = json.loads(cli(*args, "--dry-run", "--no-estimate").stdout)
    assert plan["renderer"] == "chat_template", plan  # what the server renders tools with
    result = cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    taught = client.chat.completions.create(
        model=json.loads(result.stdout)["sampler_path"], messages=QUESTION, tools=[WEATHER],
        temperature=0, max_tokens=120,
    )  # fmt: skip
    (got,) = taught.choices[0].message.tool_calls
    assert (got.function.name, json.loads(got.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    base = client.chat.completions.create(
        model=str(tools_model), messages=QUESTION, tools=[WEATHER], temperature=0, max_tokens=120
    )
    assert not base.choices[0].message.tool_calls

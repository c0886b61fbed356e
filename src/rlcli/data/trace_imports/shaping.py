"""OpenAI-shaped chat messages from the shapes tracing platforms store them in.

Every trace importer ends in the same row: ``{"messages": [...], "tools": [...]?,
"feedback": [...]}`` where a message is ``{"role", "content": str}``, an assistant turn may
carry ``tool_calls`` (``{"id"?, "type": "function", "function": {"name", "arguments": str}}``)
and a tool turn ``tool_call_id`` (and ``name``). That is what the chat-completions API takes
back, what ``rlcli traces export`` writes, and what ``train sl`` reads (``content`` is always
text, never null). What a shape holds that this cannot (images, reasoning blocks, a second
choice) is counted in ``unmapped`` by name, never dropped silently.
"""

from __future__ import annotations

import json
from collections import Counter

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "ai": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
    "observation": "tool",
}
TEXT_PARTS = ("text", "input_text", "output_text")
# Feedback entries: LangSmith's field names, which `POST /v1/feedback` and `traces export` use.
FEEDBACK_FIELDS = ("key", "score", "value", "comment", "correction", "source")


class FormatError(ValueError):
    """This record is not in the expected format; the message names the field."""


def role(value, where: str) -> str:
    found = ROLE_ALIASES.get(str(value).lower()) if isinstance(value, str) else None
    if found is None:
        raise FormatError(f"{where}.role: unknown role {value!r}")
    return found


def text_of(content, where: str, unmapped: Counter) -> str:
    """Text of a message's content: a string, or text parts joined (OpenAI ``{type: text}``,
    OTel ``{type: text, content}``, LangChain/Anthropic blocks); other parts are counted."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        raise FormatError(f"{where}: content of type {type(content).__name__} is not text")
    pieces = []
    for part in content:
        if isinstance(part, str):
            pieces.append(part)
        elif not isinstance(part, dict):
            raise FormatError(f"{where}: a content part of type {type(part).__name__}")
        elif part.get("type") in TEXT_PARTS or ("type" not in part and "text" in part):
            text = part.get("text", part.get("content"))
            pieces.append(text if isinstance(text, str) else "")
        else:
            unmapped[f"{part.get('type', 'untyped')} content part"] += 1
    return "".join(pieces)


def arguments_text(arguments) -> str:
    """Tool-call arguments as the JSON string the chat API carries (dicts are dumped)."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def tool_call(call, where: str) -> dict:
    """One call in OpenAI shape from OpenAI ``{id, function: {name, arguments}}``, LangChain
    ``{name, args, id}`` or OTel ``{type: tool_call, id, name, arguments}``."""
    if not isinstance(call, dict):
        raise FormatError(f"{where}: not an object")
    function = call.get("function") if isinstance(call.get("function"), dict) else call
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise FormatError(f"{where}.name: missing")
    arguments = function.get("arguments", function.get("args"))
    out = {"type": "function", "function": {"name": name, "arguments": arguments_text(arguments)}}
    if call.get("id"):
        out = {"id": str(call["id"]), **out}
    return out


def tool_calls(calls, where: str) -> list[dict]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise FormatError(f"{where}: not a list")
    return [tool_call(c, f"{where}[{i}]") for i, c in enumerate(calls)]


def message(
    role_name: str, content: str, calls: list | None = None, call_id=None, name=None
) -> dict:
    """A message in the shape every importer writes."""
    out = {"role": role_name, "content": content}
    if calls:
        out["tool_calls"] = calls
    if role_name == "tool":
        if call_id:
            out["tool_call_id"] = str(call_id)
        if name:
            out["name"] = str(name)
    return out


def openai_message(raw, where: str, unmapped: Counter) -> dict:
    """An OpenAI chat message (``function_call`` of the pre-tools API included); LangChain-style
    ``tool_calls`` (``name``/``args``) inside one are read too (Langfuse writes those)."""
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: not an object")
    who = role(raw.get("role"), where)
    calls = tool_calls(raw.get("tool_calls"), f"{where}.tool_calls")
    if isinstance(raw.get("function_call"), dict):
        calls.append(tool_call(raw["function_call"], f"{where}.function_call"))
    call_id = raw.get("tool_call_id")
    return message(
        who, text_of(raw.get("content"), f"{where}.content", unmapped), calls, call_id,
        raw.get("name"),
    )  # fmt: skip


LANGCHAIN_TYPES = {
    "human": "user",
    "ai": "assistant",
    "aimessagechunk": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "humanmessagechunk": "user",
    "toolmessagechunk": "tool",
}


def langchain_message(raw, where: str, unmapped: Counter) -> dict:
    """A LangChain message as LangSmith stores it: serialized (``{lc, id: [..., "AIMessage"],
    kwargs}``), ``messages_to_dict`` (``{type, data}``) or flat (``{type, content, ...}``)."""
    if "lc" in raw:
        ids = raw.get("id")
        if not isinstance(ids, list) or not ids:
            raise FormatError(f"{where}.id: a serialized message names its class in id")
        kind = str(ids[-1]).replace("Message", "").lower() or "?"
        fields = raw.get("kwargs")
    elif isinstance(raw.get("data"), dict):
        kind, fields = str(raw.get("type", "")).lower(), raw["data"]
    else:
        kind, fields = str(raw.get("type", "")).lower(), raw
    if not isinstance(fields, dict):
        raise FormatError(f"{where}.kwargs: not an object")
    if kind == "chat":
        who = role(fields.get("role"), where)
    elif kind in LANGCHAIN_TYPES:
        who = LANGCHAIN_TYPES[kind]
    else:
        raise FormatError(f"{where}.type: unknown message type {kind!r}")
    extra = (
        fields.get("additional_kwargs") if isinstance(fields.get("additional_kwargs"), dict) else {}
    )
    calls = tool_calls(fields.get("tool_calls"), f"{where}.tool_calls")
    if not calls:  # older LangChain kept the provider's own calls only here
        calls = tool_calls(extra.get("tool_calls"), f"{where}.additional_kwargs.tool_calls")
        if isinstance(extra.get("function_call"), dict):
            calls.append(tool_call(extra["function_call"], f"{where}.function_call"))
    if fields.get("invalid_tool_calls"):
        unmapped["invalid tool call"] += len(fields["invalid_tool_calls"])
    content = fields.get("content")
    if calls and isinstance(content, list):  # Anthropic's tool_use blocks repeat tool_calls
        content = [p for p in content if not (isinstance(p, dict) and p.get("type") == "tool_use")]
    return message(
        who, text_of(content, f"{where}.content", unmapped), calls, fields.get("tool_call_id"),
        fields.get("name"),
    )  # fmt: skip


def any_message(raw, where: str, unmapped: Counter) -> dict:
    """OpenAI-shaped (``role``) or LangChain-shaped (``lc``, ``type``) message."""
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: not an object")
    if "role" in raw and "lc" not in raw:
        return openai_message(raw, where, unmapped)
    if "lc" in raw or "type" in raw:
        return langchain_message(raw, where, unmapped)
    raise FormatError(f"{where}: a message needs a role (OpenAI) or a type (LangChain)")


def messages_list(raw, where: str, unmapped: Counter) -> list[dict]:
    if not isinstance(raw, list):
        raise FormatError(f"{where}: not a list")
    return [any_message(m, f"{where}[{i}]", unmapped) for i, m in enumerate(raw)]


def tool_definitions(raw, where: str) -> list[dict]:
    """Tool definitions in the chat API's shape, from it or from a flat ``{name, description,
    parameters}`` (OTel's FunctionToolDefinition, Responses-API tools)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise FormatError(f"{where}: not a list")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise FormatError(f"{where}[{i}]: not an object")
        if isinstance(tool.get("function"), dict):
            out.append({"type": "function", "function": tool["function"]})
        elif isinstance(tool.get("name"), str):
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out.append({"type": "function", "function": function})
        else:
            raise FormatError(f"{where}[{i}]: a tool definition needs a name")
    return out


def feedback(key, score=None, value=None, comment=None, correction=None, source=None) -> dict:
    """One verdict with LangSmith's field names (the same entry ``traces export`` writes)."""
    return dict(zip(FEEDBACK_FIELDS, (key, score, value, comment, correction, source), strict=True))


def as_json(value, where: str):
    """A field some exports store as a JSON string (LangSmith's bulk export, OTel attributes)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise FormatError(f"{where}: a string that is not JSON ({e.msg})") from None
    return value

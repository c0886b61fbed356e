"""Llama 3.1-3.3 JSON tool calls: the answer is ``{"name": ..., "parameters": {...}}`` (several
joined by ``;``), maybe after ``<|python_tag|>``. An answer that starts with ``{`` is held until
it ends; if it does not parse as calls it is content."""

from __future__ import annotations

import json

from rlcli.server.http.openai.tool_parsers.base import ToolCall, ToolParser, call_from_json

TAG = "<|python_tag|>"


class Llama3Json(ToolParser):
    name = "llama3_json"
    template_marks = ('"parameters"', "<|eot_id|>")

    def find(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith((TAG, "{")):
            return len(text) - len(stripped)
        return None

    def pending(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if TAG.startswith(stripped) else 0

    def calls(self, part: str, final: bool) -> list[ToolCall]:
        if not final:
            return []
        body = part.strip().removeprefix(TAG).strip()
        decoder, out, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return out
            call = call_from_json(obj, "parameters")
            if call is None:
                return out
            out.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return out

    def forced(self, name: str | None) -> str:
        if name is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(name) + ', "parameters": '

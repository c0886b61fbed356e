"""Mistral (v0.3 and later templates): ``[TOOL_CALLS]`` then a JSON list of
``{"name", "arguments"}``; text before the marker is content. Read when the answer ends."""

from __future__ import annotations

import json

from rlcli.server.http.openai.tool_parsers.base import (
    ToolCall,
    ToolParser,
    call_from_json,
    held_marker,
)

MARK = "[TOOL_CALLS]"


class Mistral(ToolParser):
    name = "mistral"
    template_marks = (MARK,)

    def find(self, text: str) -> int | None:
        i = text.find(MARK)
        return None if i < 0 else i

    def pending(self, text: str) -> int:
        return held_marker(text, MARK)

    def calls(self, part: str, final: bool) -> list[ToolCall]:
        if not final:
            return []
        body = part.removeprefix(MARK).strip()
        try:
            obj, _ = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return []
        items = obj if isinstance(obj, list) else [obj]
        out = []
        for item in items:
            call = call_from_json(item)
            if call is None:
                break
            out.append(call)
        return out

    def forced(self, name: str | None) -> str:
        if name is None:
            return MARK + '[{"name": "'
        return MARK + '[{"name": ' + json.dumps(name) + ', "arguments": '

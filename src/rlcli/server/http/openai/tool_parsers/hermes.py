"""Hermes / Qwen 2.5 / Qwen 3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
one block per call; text before the first block is content."""

from __future__ import annotations

import json
import re

from rlcli.server.http.openai.tool_parsers.base import (
    ToolCall,
    ToolParser,
    call_from_json,
    held_marker,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


class Hermes(ToolParser):
    name = "hermes"
    template_marks = (OPEN,)

    def find(self, text: str) -> int | None:
        i = text.find(OPEN)
        return None if i < 0 else i

    def pending(self, text: str) -> int:
        return held_marker(text, OPEN)

    def calls(self, part: str, final: bool) -> list[ToolCall]:
        bodies = [m.group(1) for m in BLOCK.finditer(part)]
        if final:
            tail = part[part.rfind(CLOSE) + len(CLOSE) :] if CLOSE in part else part
            if OPEN in tail:  # the answer ended before the block closed
                bodies.append(tail.split(OPEN, 1)[1])
        out = []
        for body in bodies:
            try:
                call = call_from_json(json.loads(body.strip()))
            except json.JSONDecodeError:
                call = None
            if call is None:
                break  # calls are read in order; a broken one ends them
            out.append(call)
        return out

    def forced(self, name: str | None) -> str:
        if name is None:
            return OPEN + '\n{"name": "'
        return OPEN + "\n" + '{"name": ' + json.dumps(name) + ', "arguments": '

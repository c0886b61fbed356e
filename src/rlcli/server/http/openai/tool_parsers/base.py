"""What every tool-call parser shares: the parsed call, the parser's interface, and
``ToolText``, one choice's text split into content and calls as it streams.

A parser only says where tool calls start in an answer (``find``), how much of an unfinished
answer might still become that start (``pending``), and which calls a part holds (``calls``).
``ToolText`` does the rest for streamed and whole answers alike: text before the start is
content and streams as it comes; from the start on nothing streams until a call is complete.
A part that turns out not to be calls is given back as content at the end: nothing the model
wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def call_from_json(obj, arguments_key: str = "arguments") -> ToolCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` -> a call (None: not that shape)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser:
    name = ""
    template_marks: tuple[str, ...] = ()  # what a chat template of this family contains

    def find(self, text: str) -> int | None:
        """Where the tool-call part of ``text`` starts (None: not yet)."""
        raise NotImplementedError

    def pending(self, text: str) -> int:
        """How many characters at the end of ``text`` might still start a tool-call part."""
        raise NotImplementedError

    def calls(self, part: str, final: bool) -> list[ToolCall]:
        """The calls complete in ``part`` (the text from ``find`` on). ``final``: the answer
        ended, so a call its closing marker never followed is read too if it parses."""
        raise NotImplementedError

    def forced(self, name: str | None) -> str:
        """Text that starts the answer with a call (of ``name``, or of any tool when None):
        how ``tool_choice`` ``required`` or a named function is honoured without a grammar."""
        raise NotImplementedError


class ToolText:
    """One choice's text as it arrives -> content to send now, and calls complete so far."""

    def __init__(self, parser: ToolParser, prefix: str = "") -> None:
        self.parser = parser
        self.text = prefix  # a forced prefix is part of the model's answer
        self.sent = 0  # content characters handed out
        self.start: int | None = None
        self.emitted: list[ToolCall] = []

    def push(self, delta: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self.start is None:
            self.start = self.parser.find(self.text)
        if self.start is None:
            end = len(self.text) if final else len(self.text) - self.parser.pending(self.text)
            return self._content(end), []
        content = self._content(self.start)
        calls = self.parser.calls(self.text[self.start :], final)
        new = calls[len(self.emitted) :]
        self.emitted += new
        if final and not self.emitted:  # it was not a call after all: it is text
            self.start = len(self.text)
            content += self._content(len(self.text))
        return content, new

    def _content(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece

    @property
    def content(self) -> str:
        return self.text[: self.sent]

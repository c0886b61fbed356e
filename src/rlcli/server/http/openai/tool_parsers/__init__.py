"""Tool-call parsers, one small module per model family, behind one registry (as vLLM's
``tool_parsers/``): the chat template renders ``tools`` into the prompt, a parser reads the
model's answer back into OpenAI ``tool_calls``. ``for_template`` picks the parser by what the
template itself writes, so a model gets the format it was trained on.

Families: ``hermes`` (Qwen 2.5/3, Hermes, the tiny test model: ``<tool_call>{json}</tool_call>``),
``llama3_json`` (Llama 3.1-3.3: a bare ``{"name", "parameters"}`` object, maybe after
``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS][{...}]``).
"""

from __future__ import annotations

from rlcli.server.http.openai.tool_parsers.base import ToolCall, ToolParser, ToolText
from rlcli.server.http.openai.tool_parsers.hermes import Hermes
from rlcli.server.http.openai.tool_parsers.llama3 import Llama3Json
from rlcli.server.http.openai.tool_parsers.mistral import Mistral

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Hermes, Llama3Json, Mistral)}

__all__ = ["PARSERS", "ToolCall", "ToolParser", "ToolText", "for_template"]


def for_template(template: str) -> ToolParser | None:
    """The parser for the calls this chat template teaches (None: no family recognised).
    Mistral and Hermes name their markers; Llama 3's template says ``"parameters"``."""
    for parser in (Mistral, Hermes, Llama3Json):
        if all(mark in template for mark in parser.template_marks):
            return parser()
    return None

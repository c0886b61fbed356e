"""Text in and out of the OpenAI-compatible endpoint: the base model's tokenizer in the HTTP
process (prompts in, tokens out to text), and ``TextStream``, one choice's text as its tokens
are drawn.

The chat template is the tokenizer's own (``apply_chat_template`` with the generation prompt),
loaded from the same base model the engine loads. ``rlcli sample``/``chat`` render with the
cookbook renderer ``train`` uses (``renderer_choice.resolve_renderer``); where that renderer's
tokens differ from the template's on a probe conversation (SmolLM2's template adds a default system
message, the renderer does not), ``/v1/models`` says so (``chat_template.agrees_with_rlcli``).

Tools are rendered by the template too (``apply_chat_template(tools=...)``). A template supports
them when a probe rendered with a tool differs from the same probe without one; its tool-call
parser is chosen from what the template writes (``tool_parsers.for_template``).
"""

from __future__ import annotations

import logging
from typing import Any

from rlcli.compat.renderer_choice import resolve_renderer
from rlcli.models.tokenizer import load_tokenizer
from rlcli.server.errors import UserError
from rlcli.server.http.openai import tool_parsers

log = logging.getLogger("rlcli.server")

PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_x",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {}},
    },
}


class ChatTokenizer:
    """The base model's tokenizer: chat prompts, plain prompts, and decoding."""

    def __init__(self, base_model: str, eos_ids: list[int]) -> None:
        self.tokenizer = load_tokenizer(base_model)
        self.eos_ids = frozenset(eos_ids)
        self.has_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.rlcli_renderer, self.agrees = _compare_with_renderer(base_model, self)
        self.tool_parser = self._tool_parser()

    def _tool_parser(self) -> tool_parsers.ToolParser | None:
        """The parser of this template's tool calls (None: the template renders no tools)."""
        if not self.has_template:
            return None
        try:
            with_tool = self._render(PROBE, [PROBE_TOOL])
            plain = self._render(PROBE, None)
        except Exception as e:
            log.info("chat template: tools not rendered (%s)", e)
            return None
        if with_tool == plain or "probe_tool_x" not in with_tool:
            return None
        template = self.tokenizer.chat_template
        source = template if isinstance(template, str) else str(template)
        return tool_parsers.for_template(source)

    def _render(self, messages, tools) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None
    ) -> list[int]:
        if not self.has_template:
            raise UserError(
                "messages: this model's tokenizer has no chat template; use /v1/completions"
            )
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True,
                return_dict=False,
            )  # fmt: skip
        except Exception as e:  # the template's own raise_exception (roles out of order, ...)
            raise UserError(f"messages: the chat template refused them: {e}") from None
        return [int(t) for t in ids]

    def encode(self, text: str) -> list[int]:
        """A completions prompt: the tokens ``rlcli sample --raw`` sends for the same text."""
        return [int(t) for t in self.tokenizer.encode(text)]

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def metadata(self) -> dict[str, Any]:
        return {
            "source": "the tokenizer's chat template" if self.has_template else None,
            "rlcli_renderer": self.rlcli_renderer,
            "agrees_with_rlcli": self.agrees,
            "tool_parser": self.tool_parser.name if self.tool_parser else None,
        }


def _compare_with_renderer(base_model: str, chat: ChatTokenizer) -> tuple[str | None, bool | None]:
    """The renderer ``rlcli sample`` picks for the model, and whether it renders a probe
    conversation to the same tokens as the chat template (None: could not tell)."""
    try:
        from tinker_cookbook import renderers

        name, _, tokenizer = resolve_renderer(base_model, None)
        renderer = renderers.get_renderer(name, tokenizer or chat.tokenizer)
        theirs = renderer.build_generation_prompt(PROBE).to_ints()
        return name, chat.has_template and list(theirs) == chat.chat_prompt(PROBE)
    except Exception as e:
        log.info("chat template vs rlcli's renderer: not compared (%s)", e)
        return None, None


class TextStream:
    """One choice's text while its tokens arrive: what can be sent now, and the final text.

    The terminal EOS / end-of-turn token is not text. A stop string ends the text where it
    starts (OpenAI's rule: the stop string is not returned). Until the row finishes, text that
    could still become a stop string, and an unfinished UTF-8 character, are held back."""

    def __init__(self, decode, stops: list[str], eos_ids: frozenset[int]) -> None:
        self.decode, self.stops, self.eos_ids = decode, [s for s in stops if s], eos_ids
        self.tokens: list[int] = []  # the tokens that are text
        self.drawn = 0  # every token drawn (usage), the terminal one included
        self.sent = ""  # text already handed out
        self.finish_reason: str | None = None
        self.stopped_by_string = False

    def push(self, token: int, reason: str | None) -> tuple[str, bool]:
        """Add a drawn token; (the text that can be sent now, whether the token is text)."""
        self.drawn += 1
        is_text = not (reason == "stop" and token in self.eos_ids)
        if is_text and not self.stopped_by_string:
            self.tokens.append(token)
        if reason is not None:
            self.finish_reason = reason
        return self._advance(final=reason is not None), is_text

    def _advance(self, final: bool) -> str:
        if self.stopped_by_string:
            return ""
        text = self.decode(self.tokens)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, final = text[:cut], True
            self.stopped_by_string = True
            self.finish_reason = "stop"
        elif not final:
            text = text.rstrip("\ufffd")  # a character whose bytes have not all arrived
            text = text[: len(text) - _stop_prefix(text, self.stops)]
        if not text.startswith(self.sent):  # a decode that rewrote earlier text: resend nothing
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    @property
    def text(self) -> str:
        return self.sent


def _stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is the start of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best

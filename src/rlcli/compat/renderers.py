"""The model's own chat template as a cookbook renderer, and the check that picks it.

A cookbook renderer writes a conversation its own way; a model is served (transformers, vLLM,
``rlcli export --merge``) with the chat template its tokenizer carries. Where the two differ
(SmolLM2's template adds a default system prompt that ``qwen3_instruct`` leaves out), a model
trained through the renderer is asked in production in a form it was not trained on.
``TemplateRenderer`` renders through ``tokenizer.apply_chat_template`` itself, so its tokens are
the template's; ``compare`` says whether a cookbook renderer reproduces the template token for
token on a few probe conversations, and ``renderer_choice.resolve_renderer`` uses it to choose.

Weights: an assistant message's tokens are those between the template's generation prompt for
the conversation before it and the end of its own end-of-turn token (what sampling produces);
every other token has weight 0. The stop sequence is the token the template ends an assistant
turn with (``tokenizer.end_of_turn_id``), else the tokenizer's eos.
"""

from __future__ import annotations

import json

import tinker
import torch
from tinker_cookbook.renderers import base
from tinker_cookbook.renderers.base import (
    Message,
    ParseTermination,
    RenderContext,
    RenderedMessage,
    Renderer,
    RendererError,
    TrainOnWhat,
)

from rlcli.models.tokenizer import end_of_turn_id

NAME = "chat_template"  # the name recipes, --renderer and config.yaml use

# Conversations the check renders both ways: with and without a system message, one turn and
# many. Plain text only; a template that needs more (tools, thinking) shows up as a difference.
_SYSTEM = {"role": "system", "content": "You are a terse assistant."}
_TURNS = [
    {"role": "user", "content": "What is the tallest mountain?"},
    {"role": "assistant", "content": "Mount Everest, 8,849 m."},
    {"role": "user", "content": "And in Africa?\nOne line, please."},
    {"role": "assistant", "content": " Kilimanjaro  (5,895 m)."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]
PROBES = {
    "one turn, no system message": _TURNS[:2],
    "one turn with a system message": [_SYSTEM, *_TURNS[:2]],
    "three turns, no system message": _TURNS,
    "three turns with a system message": [_SYSTEM, *_TURNS],
}


# The key of the system message ``TemplateRenderer.create_conversation_prefix_with_tools``
# returns: it carries the tools to ``apply_chat_template(tools=...)``, which writes them itself.
TOOLS_KEY = "rlcli_tools"


def _plain(messages: list[Message]) -> tuple[list[dict], list[dict] | None]:
    """What a chat template reads: role and text content, OpenAI's tool calls (arguments as an
    object: what the model writes, and what templates put in ``<tool_call>``) and tool
    results' ids; and the tools, if the conversation offers them."""
    out, tools = [], None
    for m in messages:
        if TOOLS_KEY in m:
            tools = [{"type": "function", "function": dict(t)} for t in m[TOOLS_KEY]]
            if not m["content"]:
                continue  # the template writes its own system message for the tools
        plain = {"role": m["role"], "content": base.get_text_content(m)}
        if m.get("tool_calls"):
            plain["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        if m.get("tool_call_id"):
            plain["tool_call_id"] = m["tool_call_id"]
        out.append(plain)
    return out, tools


def _template_call(call) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    body = {"name": call.function.name, "arguments": arguments}
    return {"type": "function", "function": body, **({"id": call.id} if call.id else {})}


def template_tokens(tokenizer, messages: list, generation_prompt: bool) -> list[int]:
    """``apply_chat_template``'s tokens for ``messages`` (a plain list of ints)."""
    plain, tools = _plain(messages)
    out = tokenizer.apply_chat_template(
        plain, tools=tools, tokenize=True, add_generation_prompt=generation_prompt
    )
    if hasattr(out, "keys") and "input_ids" in out:  # a BatchEncoding (return_dict)
        out = out["input_ids"]
    return [int(t) for t in out]


class TemplateRenderer(Renderer):
    """A renderer whose every token is the tokenizer's own chat template's (see the module)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            raise RendererError(f"{NAME}: the tokenizer has no chat template")

        stop = end_of_turn_id(tokenizer)
        if stop is None:
            stop = tokenizer.eos_token_id
        if not isinstance(stop, int):
            raise RendererError(f"{NAME}: the chat template ends turns with no special token")
        self.stop_token = stop

    @property
    def has_extension_property(self) -> bool:
        return True  # build_supervised_example refuses a conversation where it does not hold

    def get_stop_sequences(self) -> list[int]:
        return [self.stop_token]

    def _tokens(self, messages: list[Message], generation_prompt: bool) -> list[int]:
        return template_tokens(self.tokenizer, messages, generation_prompt)

    def build_generation_prompt(
        self, messages: list[Message], role: str = "assistant", prefill: str | None = None
    ) -> tinker.ModelInput:
        if role != "assistant":
            raise RendererError(f"{NAME}: a chat template prompts the assistant only, not {role}")
        tokens = self._tokens(messages, generation_prompt=True)
        if prefill:
            tokens += self.tokenizer.encode(prefill, add_special_tokens=False)
        return tinker.ModelInput.from_ints(tokens)

    def build_supervised_example(
        self,
        messages: list[Message],
        train_on_what: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_MESSAGE,
    ) -> tuple[tinker.ModelInput, torch.Tensor]:
        tokens = self._tokens(messages, generation_prompt=False)
        weights = torch.zeros(len(tokens))
        if train_on_what == TrainOnWhat.ALL_TOKENS:
            return tinker.ModelInput.from_ints(tokens), torch.ones(len(tokens))
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        for idx, message in enumerate(messages):
            if not self._trained(message, idx, len(messages), last_user, train_on_what):
                continue
            start, end = self._span(messages, idx, tokens)
            weights[start:end] = 1.0
        return tinker.ModelInput.from_ints(tokens), weights

    @staticmethod
    def _trained(message, idx: int, count: int, last_user: int, mode: TrainOnWhat) -> bool:
        assistant = message["role"] == "assistant"
        match mode:
            case TrainOnWhat.LAST_ASSISTANT_MESSAGE:
                return assistant and idx == count - 1
            case TrainOnWhat.LAST_ASSISTANT_TURN:
                return assistant and idx > last_user
            case TrainOnWhat.ALL_ASSISTANT_MESSAGES:
                return assistant
            case TrainOnWhat.ALL_MESSAGES:
                return True
            case TrainOnWhat.ALL_USER_AND_SYSTEM_MESSAGES:
                return message["role"] in ("user", "system")
            case TrainOnWhat.CUSTOMIZED:
                return bool(message.get("trainable", False))
        raise RendererError(f"{NAME}: unknown train_on_what {mode}")

    def _span(self, messages: list[Message], idx: int, tokens: list[int]) -> tuple[int, int]:
        """Where message ``idx`` is in ``tokens``: an assistant message from the end of the
        generation prompt before it through its end-of-turn token; any other from the end of
        the message before it to its own end."""
        if messages[idx]["role"] == "assistant":
            before = self._tokens(messages[:idx], generation_prompt=True)
        else:
            before = self._tokens(messages[:idx], generation_prompt=False) if idx else []
        upto = self._tokens(messages[: idx + 1], generation_prompt=False)
        if tokens[: len(before)] != before or tokens[: len(upto)] != upto:
            raise RendererError(
                f"{NAME}: the chat template writes message {idx} differently once later "
                "messages follow it, so no single sequence trains it as it is sampled; "
                "pass --renderer with a cookbook renderer for this model"
            )
        start, end = len(before), len(upto)
        if messages[idx]["role"] == "assistant" and self.stop_token in tokens[start:end]:
            end = start + tokens[start:end].index(self.stop_token) + 1  # not what follows it
        return start, end

    def create_conversation_prefix_with_tools(
        self, tools: list, system_prompt: str = ""
    ) -> list[Message]:
        """A system message carrying the tools: the template writes them where it does."""
        return [{"role": "system", "content": system_prompt, TOOLS_KEY: list(tools)}]

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        """One message on its own (the cookbook's default helpers): the template's rendering
        of the conversation up to it, less the conversation before it, as output."""
        previous = [ctx.prev_message] if ctx.prev_message is not None else []
        before = self._tokens(previous, generation_prompt=False) if previous else []
        upto = self._tokens([*previous, message], generation_prompt=False)
        return RenderedMessage(output=[tinker.EncodedTextChunk(tokens=upto[len(before) :])])

    def parse_response(self, response: list[int]) -> tuple[Message, ParseTermination]:
        return base.parse_response_for_stop_token(response, self.tokenizer, self.stop_token)


def register() -> None:
    """Make ``NAME`` a renderer the cookbook's ``get_renderer`` builds (in this process)."""
    from tinker_cookbook import renderers

    if not renderers.is_renderer_registered(NAME):
        renderers.register_renderer(NAME, lambda tokenizer, image_processor=None: (
            TemplateRenderer(tokenizer)))  # fmt: skip


def compare(name: str, tokenizer) -> str | None:
    """None when renderer ``name`` reproduces the tokenizer's chat template token for token on
    every probe (each generation prompt before an assistant message, and each whole
    conversation through its last end-of-turn token); else where it first differs, in
    words."""
    from tinker_cookbook import renderers

    register()
    stop = end_of_turn_id(tokenizer)
    try:
        renderer = renderers.get_renderer(name, tokenizer)
    except Exception as e:
        return f"cannot be built for this tokenizer ({type(e).__name__})"
    for what, conversation in PROBES.items():
        try:
            for end in range(1, len(conversation) + 1):
                if conversation[end - 1]["role"] != "assistant":
                    continue
                prompt = conversation[: end - 1]
                ours = renderer.build_generation_prompt(prompt).to_ints()
                if ours != template_tokens(tokenizer, prompt, generation_prompt=True):
                    return _difference(tokenizer, ours, prompt, True, what)
            ours = renderer.build_supervised_example(conversation)[0].to_ints()
            theirs = template_tokens(tokenizer, conversation, generation_prompt=False)
            if _through_last_turn(ours, stop) != _through_last_turn(theirs, stop):
                return _difference(tokenizer, ours, conversation, False, what)
        except Exception as e:  # a template that cannot render plain turns: not a match
            return f"fails on {what} ({type(e).__name__}: {str(e)[:80]})"
    return None


def _through_last_turn(tokens: list[int], stop: int | None) -> list[int]:
    """``tokens`` through the last end-of-turn token: what follows it (ChatML's newline) is
    never sampled, and is part of no prompt unless another turn follows (checked as such)."""
    if stop is None or stop not in tokens:
        return tokens
    return tokens[: len(tokens) - tokens[::-1].index(stop)]


def _difference(tokenizer, ours: list[int], messages, generation_prompt: bool, what: str) -> str:
    theirs = template_tokens(tokenizer, messages, generation_prompt)
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    at = min(len(ours), len(theirs)) if at is None else at
    kind = "generation prompt" if generation_prompt else "conversation"
    return (
        f"its {kind} for {what} differs from the template's at token {at}: "
        f"{tokenizer.decode(ours[at : at + 8])!r} vs {tokenizer.decode(theirs[at : at + 8])!r}"
    )

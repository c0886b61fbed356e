"""Request bodies of the OpenAI-compatible endpoint, typed at the boundary like
``tinker/schemas.py``.

Fields follow the OpenAI API (chat completions and legacy completions). ``tools``,
``tool_choice``, assistant ``tool_calls`` and ``role: tool`` messages are typed here and rendered
by the model's own chat template (``text.py``). What this server does not do is named, not
ignored: the deprecated ``functions``, a ``response_format`` other than text, images and audio
in messages, ``logit_bias``, penalties, ``echo``, ``suffix`` and ``best_of`` are each a 400
naming the field (``refusals``). Fields OpenAI clients send that change nothing here
(``user``, ``metadata``, ``store``, ...) are accepted and ignored. ``stop_token_ids`` and
``ignore_eos`` are vLLM's extensions (``rlcli chat`` sends its renderer's stop tokens with the
first; the second draws ``max_tokens`` past EOS, as load generators ask).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlcli.server.errors import UserError

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, Field(ge=1, le=128)]  # n: completions per prompt (Tinker's cap too)
Tokens = Annotated[int, Field(ge=0, le=2**31 - 1)]
ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(UserError):
    """A refusal in OpenAI's terms: the field (``param``), a ``code`` and the HTTP status."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class Body(BaseModel):
    model_config = ConfigDict(
        strict=True, allow_inf_nan=False, extra="ignore", protected_namespaces=()
    )


class StreamOptions(Body):
    include_usage: bool = False


class ContentPart(Body):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: str
    text: str | None = None


class FunctionCall(Body):
    name: str
    arguments: str  # a JSON object as a string, as OpenAI sends it


class ToolCallIn(Body):
    """An assistant message's earlier tool call, in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class Function(Body):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: Function


class NamedFunction(Body):
    name: str


class ToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class Sampling(Body):
    """What both endpoints share."""

    model: str
    max_tokens: Tokens | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n: Count = 1
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[Tokens] | None = None  # vLLM's extension: token ids that end a row
    ignore_eos: bool = False  # vLLM's extension: draw max_tokens, past EOS (benchmarks, tests)
    # refused unless neutral
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    def common_refusals(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise OpenAIError(f"{name}: penalties are not supported by this server", name)
        if self.logit_bias:
            raise OpenAIError("logit_bias: not supported by this server", "logit_bias")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 64 or any(len(s) > 1024 for s in stops):
            raise OpenAIError("stop: at most 64 strings of at most 1024 characters", "stop")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options: only allowed with stream: true", "stream_options")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletion(Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message]
    max_completion_tokens: Tokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; the model decides how many it makes
    # refused
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None

    def refusals(self) -> None:
        self.common_refusals()
        for name in ("functions", "function_call"):
            if getattr(self, name) not in (None, [], "none"):
                raise OpenAIError(f"{name}: deprecated by OpenAI; send tools instead", name)
        if self.audio is not None:
            raise OpenAIError("audio: not supported by this server", "audio")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise OpenAIError("tool_choice: needs tools", "tool_choice")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise OpenAIError("tools: two tools have the same name", "tools")
        chosen = self.chosen_function
        if chosen is not None and chosen not in names:
            raise OpenAIError(
                f"tool_choice.function.name: {chosen!r} is not one of the tools", "tool_choice"
            )
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise OpenAIError(
                f"response_format: type {kind!r} is not supported (only 'text')", "response_format"
            )
        if self.modalities and self.modalities != ["text"]:
            raise OpenAIError("modalities: only ['text'] is supported", "modalities")
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError("top_logprobs: needs logprobs: true", "top_logprobs")
        if not self.messages:
            raise OpenAIError("messages: empty; send at least one message", "messages")
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise OpenAIError(
                "max_tokens: differs from max_completion_tokens; send one of them", "max_tokens"
            )

    @property
    def limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    @property
    def chosen_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, ToolChoice) else None

    @property
    def calls_wanted(self) -> bool:
        """Whether the answer is read for tool calls (tools given and not ``tool_choice: none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_specs(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (``tool_choice`` none: no tools; a named
        function: that one only)."""
        if not self.calls_wanted:
            return None
        chosen = self.chosen_function
        return [
            t.model_dump(exclude_none=True)
            for t in self.tools or []
            if chosen is None or t.function.name == chosen
        ]

    def uses_tools(self) -> str | None:
        """The first field that needs a template with tool support (None: none does)."""
        if self.calls_wanted:
            return "tools"
        for i, message in enumerate(self.messages):
            if message.role == "tool":
                return f"messages[{i}].role"
            if message.tool_calls:
                return f"messages[{i}].tool_calls"
        return None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them; 400 naming a message that is not
        text in a known role, or a tool call whose arguments are not a JSON object."""
        out = []
        for i, message in enumerate(self.messages):
            where = f"messages[{i}]"
            if message.role not in ROLES:
                raise OpenAIError(
                    f"{where}.role: {message.role!r} is not one of {', '.join(ROLES)}",
                    f"{where}.role",
                )
            extra = sorted(set(message.model_extra or {}) - {"refusal"})
            if extra:
                raise OpenAIError(
                    f"{where}.{extra[0]}: not supported (text messages only)", f"{where}.{extra[0]}"
                )
            content = message.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise OpenAIError(
                            f"{where}.content[{j}].type: {part.type!r} parts are not supported "
                            "(text only: this model reads no images, audio or files)",
                            f"{where}.content[{j}].type",
                        )
                    texts.append(part.text)
                content = "".join(texts)
            if content is None and not message.tool_calls:
                raise OpenAIError(f"{where}.content: missing", f"{where}.content")
            role = "system" if message.role == "developer" else message.role
            turn: dict[str, Any] = {"role": role, "content": content or ""}
            if message.tool_calls:
                if role != "assistant":
                    raise OpenAIError(
                        f"{where}.tool_calls: only assistant messages make tool calls",
                        f"{where}.tool_calls",
                    )
                turn["tool_calls"] = [
                    _template_call(call, f"{where}.tool_calls[{j}]")
                    for j, call in enumerate(message.tool_calls)
                ]
            if role == "tool":
                turn["tool_call_id"] = message.tool_call_id
                if message.name:
                    turn["name"] = message.name
            out.append(turn)
        return out


def _template_call(call: ToolCallIn, where: str) -> dict[str, Any]:
    """A history tool call as chat templates read it: ``arguments`` a mapping (Hugging Face's
    convention; templates write it with ``tojson``)."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as e:
        arguments = None
        problem = f"not JSON ({e.msg} at column {e.colno})"
    else:
        problem = None if isinstance(arguments, dict) else "not a JSON object"
    if problem:
        param = f"{where}.function.arguments"
        raise OpenAIError(f"{param}: {problem}", param)
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class Completion(Sampling):
    """``POST /v1/completions`` (the legacy text endpoint)."""

    prompt: str | list[str] | list[Tokens] | list[list[Tokens]]
    max_tokens: Tokens | None = 16  # OpenAI's default for this endpoint
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # refused
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refusals(self) -> None:
        self.common_refusals()
        if self.echo:
            raise OpenAIError("echo: not supported by this server", "echo")
        if self.suffix:
            raise OpenAIError("suffix: insertion is not supported by this server", "suffix")
        if self.best_of not in (None, 1, self.n):
            raise OpenAIError("best_of: not supported by this server (use n)", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """One or more prompts: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError("prompt: empty; send text or token ids", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if len(p) > 64:
            raise OpenAIError("prompt: at most 64 prompts per request", "prompt")
        return list(p)


Kind = Literal["chat", "text"]

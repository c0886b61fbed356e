"""Talking to a model through the Tinker API: what ``rlcli sample`` and ``rlcli chat`` share.

A ``Target`` is what to sample from: a base model the server hosts, or a sampler checkpoint
(``tinker://RUN/sampler_weights/NAME``) with the base model it was trained on (asked from the
server: the tokenizer and the chat template come from the base model). Every problem found
before sampling (dead server, unknown model, a training-state path, a missing checkpoint) is
one ``RlcliError`` line; the SDK alone would retry a dead server for minutes.

A ``Talker`` renders a conversation with the cookbook renderer the train commands use
(``renderer_choice.resolve_renderer``), so a checkpoint trained by ``rlcli train sl`` is
asked in the format it learned; ``raw`` sends the text's tokens as they are. The Tinker sample API
returns whole completions; ``Talker.stream`` sends the same rendered tokens to the server's
OpenAI-compatible ``/v1/completions`` instead, which streams them from the same decode loop
(``rlcli chat``), and says ``NoStreaming`` for a server without it (SkyRL's).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import httpx

from rlcli.checkpoint_format import TinkerPathError, parse_tinker_path
from rlcli.client import aliases, endpoint
from rlcli.client.server_info import Server, server_reason
from rlcli.compat.renderer_choice import resolve_renderer
from rlcli.compat.skyrl_client import accept_unnumbered_samples
from rlcli.errors import RlcliError
from rlcli.models.gguf import local_model

KINDS = ("weights", "sampler_weights")  # what sample, chat and export take


@dataclass(frozen=True)
class Target:
    base_url: str
    base_model: str
    checkpoint: str | None = None  # a tinker://.../sampler_weights/... path, or the base model

    @property
    def label(self) -> str:
        return self.checkpoint or self.base_model


def split_tinker_path(path: str, flag: str = "--checkpoint") -> tuple[str, str, str]:
    """``tinker://RUN/KIND/NAME`` -> (run, kind, name), or one line saying the expected form."""
    try:  # the server's own rules: what it would refuse is refused here, before asking it
        ref = parse_tinker_path(path)
    except TinkerPathError:
        ref = None
    if ref is None or ref.kind not in KINDS:
        raise RlcliError(
            f"{flag} {path}: not a checkpoint path; expected tinker://RUN/sampler_weights/NAME "
            "or tinker://RUN/weights/NAME"
        )
    return ref.run_id, ref.kind, ref.name


def post_json(url: str, path: str, body: dict, *, timeout: float = 10.0) -> httpx.Response:
    """POST with our API key; the response (any status), or one line if nothing answers."""
    try:
        return httpx.post(f"{url}{path}", json=body, headers=endpoint.headers(), timeout=timeout)
    except httpx.HTTPError as e:
        raise RlcliError(f"no answer from {url}{path} ({type(e).__name__})") from None


def checkpoint_base_model(url: str, path: str, flag: str = "--checkpoint") -> dict[str, Any]:
    """The server's ``weights_info`` for a checkpoint (base model, LoRA rank); one line if the
    server does not hold it."""
    response = post_json(url, "/api/v1/weights_info", {"tinker_path": path})
    if response.status_code in (400, 404, 422):
        raise RlcliError(f"{flag} {path}: the server at {url} has no such checkpoint")
    if response.status_code >= 400:
        raise RlcliError(
            f"{flag} {path}: the server at {url} answered HTTP {response.status_code}: "
            f"{endpoint._detail(response)}"
        )
    info = response.json()
    if not isinstance(info, dict) or not info.get("base_model"):
        raise RlcliError(f"{flag} {path}: the server at {url} did not name its base model")
    return info


def run_checkpoints(url: str, run_id: str) -> list[str]:
    """The tinker:// paths of a run's checkpoints on the server, or [] if it does not list them."""
    try:
        listed = endpoint.get_json(url, f"/api/v1/training_runs/{run_id}/checkpoints")
    except RlcliError:
        return []
    return [c.get("tinker_path") for c in listed.get("checkpoints") or [] if c.get("tinker_path")]


def resolve_target(
    base_url: str,
    source: str,
    model: str | None,
    checkpoint: str | None,
    max_tokens: int | None = None,
) -> Target:
    """Check the server and what to sample from; one line for each way it can be wrong."""
    if not model and not checkpoint:
        raise RlcliError("pass --model MODEL (a base model) or --checkpoint tinker://...")
    endpoint.check_server(base_url, source=source)
    if aliases.is_alias_name(checkpoint):  # the checkpoint the alias serves now
        version = aliases.resolve(base_url, checkpoint)
        served = version["checkpoint"]
        checkpoint = served if served.startswith("tinker://") else None
        model = model or version["base_model"]
    server = Server(base_url)
    if max_tokens is not None:
        server.check_max_tokens(max_tokens)
    if model:  # a .gguf becomes the folder the server loaded from it
        model = local_model(model, report=None)
    if not checkpoint:
        server.check_model(model)
        return Target(base_url, model)
    run_id, kind, name = split_tinker_path(checkpoint)
    if kind == "weights":
        sampler = f"tinker://{run_id}/sampler_weights/{name}"
        hint = (
            f"; the server has its sampler weights: --checkpoint {sampler}"
            if sampler in run_checkpoints(base_url, run_id)
            else "; save sampler weights (save_weights_for_sampler) to sample from it"
        )
        raise RlcliError(
            f"--checkpoint {checkpoint}: a training state (weights/), not samplable{hint}"
        )
    info = checkpoint_base_model(base_url, checkpoint)
    return Target(base_url, model or info["base_model"], checkpoint)


@dataclass
class Reply:
    text: str
    tokens: list[int]
    stop_reason: str
    parse: str | None = None  # the renderer's termination (stop_sequence, eos, ...); raw: None

    def as_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "tokens": len(self.tokens),
            "stop_reason": self.stop_reason,
            "parse": self.parse,
        }


@dataclass
class SamplingSettings:
    """What ``sample`` and ``chat`` ask of each answer (their flags; chat's /commands)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Talker:
    """A sampling client plus the renderer (or raw tokenizer) for one target."""

    target: Target
    renderer_name: str | None = None
    raw: bool = False
    why: str = ""
    _tokenizer: Any = field(default=None, repr=False)
    _renderer: Any = field(default=None, repr=False)
    _client: Any = field(default=None, repr=False)

    def open(self) -> Talker:
        from tinker_cookbook import renderers

        name, why, tokenizer = resolve_renderer(self.target.base_model, self.renderer_name)
        if tokenizer is None:
            raise RlcliError(
                f"cannot load the tokenizer of {self.target.base_model} here (the base model "
                "of what you sample); pass --model with a local copy or its hub id"
            )
        self._tokenizer = tokenizer
        if not self.raw:
            try:
                self._renderer = renderers.get_renderer(name, tokenizer)
            except Exception as e:
                raise RlcliError(f"--renderer {name}: {e}") from None
            self.renderer_name, self.why = name, why
        self._client = self._sampling_client()
        return self

    def _sampling_client(self):
        import tinker

        accept_unnumbered_samples()  # a SkyRL server answers samples the 0.25 way
        service = tinker.ServiceClient(base_url=self.target.base_url, api_key=endpoint.api_key())
        try:
            if self.target.checkpoint:
                return service.create_sampling_client(model_path=self.target.checkpoint).result()
            return service.create_sampling_client(base_model=self.target.base_model).result()
        except tinker.APIStatusError as e:
            raise RlcliError(f"{self.target.label}: the server refused it: {e}") from None

    def prompt(self, messages: list[dict] | None = None, text: str | None = None):
        """The prompt as a ``ModelInput``: a conversation rendered for generation, or raw text."""
        from tinker import types

        if self.raw:
            return types.ModelInput.from_ints(self._tokenizer.encode(text or ""))
        return self._renderer.build_generation_prompt(messages or [])

    def submit(self, prompt, settings: SamplingSettings, num_samples: int = 1) -> Future:
        """Ask the server; the SDK's future (``.result()`` waits, ``.cancel()`` gives up)."""
        from tinker import types

        params = types.SamplingParams(
            max_tokens=settings.max_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            seed=settings.seed,
            stop=None if self.raw else self._renderer.get_stop_sequences(),
        )
        return self._client.sample(prompt, num_samples, params)

    def stream(self, prompt, settings: SamplingSettings) -> Iterator[tuple[str, str | None]]:
        """The reply as it is drawn: (text, finish reason or None) pieces, through the server's
        ``/v1/completions`` with the rendered prompt's tokens and the renderer's stops. Closing
        the iterator (Ctrl-C) hangs up, and the server drops the reply's row."""
        stops = [] if self.raw else list(self._renderer.get_stop_sequences())
        body = {
            "model": self.target.label,
            "prompt": prompt.to_ints(),
            "max_tokens": settings.max_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "seed": settings.seed,
            "stream": True,
            "stop": [x for x in stops if isinstance(x, str)] or None,
            "stop_token_ids": [x for x in stops if isinstance(x, int)] or None,
        }
        url = f"{self.target.base_url}/v1/completions"
        headers, timeout = endpoint.headers(), httpx.Timeout(10.0, read=None)
        try:
            with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
                if r.status_code >= 400:
                    r.read()
                    error = _json(r).get("error")
                    if r.status_code in (404, 405) and not isinstance(error, dict):
                        raise NoStreaming(url)
                    message = error.get("message") if isinstance(error, dict) else r.text[:200]
                    raise RlcliError(f"sampling {self.target.label} failed: {message}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        message = chunk["error"].get("message")
                        raise RlcliError(f"sampling {self.target.label} failed: {message}")
                    for choice in chunk.get("choices") or []:
                        yield choice.get("text") or "", choice.get("finish_reason")
        except httpx.HTTPError as e:
            raise RlcliError(
                f"sampling {self.target.label}: lost the server at {self.target.base_url} "
                f"({type(e).__name__})"
            ) from None

    def replies(self, response) -> list[Reply]:
        from tinker_cookbook.renderers import get_text_content

        out = []
        for seq in response.sequences:
            tokens = list(seq.tokens)
            stop = str(getattr(seq.stop_reason, "value", seq.stop_reason))
            if self.raw:  # the model's EOS ends a sample; it is not part of the text
                eos = self._tokenizer.eos_token_id
                shown = tokens[:-1] if tokens and tokens[-1] == eos else tokens
                out.append(Reply(self._tokenizer.decode(shown), tokens, stop))
                continue
            message, termination = self._renderer.parse_response(tokens)
            text = get_text_content(message)
            out.append(Reply(text, tokens, stop, str(getattr(termination, "value", termination))))
        return out


class NoStreaming(RlcliError):
    """The server has no OpenAI-compatible endpoint (a SkyRL server): sample whole replies."""


def _json(response: httpx.Response) -> dict:
    try:
        value = response.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def sample_error(target: Target, error: BaseException) -> RlcliError:
    """An SDK failure while sampling, as one line."""
    import tinker

    if isinstance(error, tinker.APIStatusError):
        return RlcliError(f"sampling {target.label} failed: {server_reason(error)}")
    if isinstance(error, tinker.APIConnectionError):
        return RlcliError(f"sampling {target.label}: lost the server at {target.base_url}")
    return RlcliError(f"sampling {target.label} failed: {type(error).__name__}: {error}")

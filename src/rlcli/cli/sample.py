"""``rlcli sample`` and ``rlcli chat``: talk to a base model or a sampler checkpoint.

Thin over ``rlcli.client.sample_chat`` (target checks, rendering, sampling).
Completions go to stdout, everything else (which server, which renderer, the waiting spinner)
to stderr.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import typer

from rlcli.cli._output import emit, info
from rlcli.errors import RlcliError

NO_STREAMING = (
    "This server has no OpenAI-compatible endpoint to stream from: each answer appears when it "
    "is complete."
)

MODEL = typer.Option(None, "--model", "-m", help="Base model the server hosts (hub id or folder).")
CHECKPOINT = typer.Option(
    None,
    "--checkpoint",
    "-c",
    help="tinker://RUN/sampler_weights/NAME, or an alias (rlcli alias list), to sample from "
    "(its base model is asked from the server; --model overrides where the tokenizer is loaded "
    "from).",
)
MAX_TOKENS = typer.Option(256, "--max-tokens", min=1, help="Most tokens per completion.")
TEMPERATURE = typer.Option(1.0, "--temperature", min=0.0, help="0 = greedy.")
TOP_P = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")
SEED = typer.Option(None, "--seed", min=0, help="Sampling seed (same seed, same completion).")
SYSTEM = typer.Option(None, "--system", help="A system message before the conversation.")
RENDERER = typer.Option(
    None, "--renderer", help="Cookbook renderer (default: the one train uses for the model)."
)
BASE_URL = typer.Option(
    None, "--base-url", help="Server (default: $TINKER_BASE_URL, the one running here, :8000)."
)


def _open(base_url, model, checkpoint, renderer, raw, max_tokens):
    from rlcli.client import endpoint, sample_chat
    from rlcli.recipes.preflight import check_renderer

    if not raw:
        check_renderer(renderer)
    url, source = endpoint.resolve_base_url(base_url)
    target = sample_chat.resolve_target(url, source, model, checkpoint, max_tokens)
    info(endpoint.describe(url, source))
    talker = sample_chat.Talker(target, renderer, raw).open()
    how = "raw tokens, no chat template" if raw else f"{talker.renderer_name} ({talker.why})"
    info(f"model: {target.label}; prompt: {how}")
    return talker


def _read_prompt(prompt: str | None) -> str:
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
        if not text.strip():
            raise RlcliError("--prompt -: nothing on stdin")
        return text.rstrip("\n")
    if prompt is None:
        raise RlcliError("--prompt TEXT is required (or '-' to read it from stdin)")
    return prompt


def _wait(future, spinner: bool):
    """The future's result, with a spinner on a terminal's stderr meanwhile."""
    stop = threading.Event()

    def spin() -> None:
        frames = "|/-\\"
        i = 0
        while not stop.wait(0.15):
            sys.stderr.write(f"\r{frames[i % 4]} ")
            sys.stderr.flush()
            i += 1

    thread = threading.Thread(target=spin, daemon=True)
    if spinner:
        thread.start()
    try:
        while True:
            try:
                return future.result(timeout=0.1)
            except TimeoutError:
                continue
    finally:
        stop.set()
        if spinner:
            thread.join()
            sys.stderr.write("\r  \r")
            sys.stderr.flush()


def sample(
    prompt: str = typer.Option(
        None, "--prompt", "-p", help="The user message ('-' or piped stdin: read it from stdin)."
    ),
    model: str = MODEL,
    checkpoint: str = CHECKPOINT,
    max_tokens: int = MAX_TOKENS,
    temperature: float = TEMPERATURE,
    top_p: float = TOP_P,
    num_samples: int = typer.Option(1, "--num-samples", "-n", min=1, max=64, help="Completions."),
    seed: int = SEED,
    system: str = SYSTEM,
    raw: bool = typer.Option(
        False, "--raw", help="Send the prompt's tokens as they are (no chat template)."
    ),
    renderer: str = RENDERER,
    base_url: str = BASE_URL,
    as_json: bool = typer.Option(
        False, "--json", help="Completions, token counts and stop reasons as JSON."
    ),
) -> None:
    """Sample completions for one prompt from a base model or a sampler checkpoint.

    The prompt gets the model's chat template (the renderer `rlcli train` uses) unless --raw.

    Completions go to stdout (several: each under a `--- sample i/N ---` line), the rest to stderr.
    """
    from rlcli.client import sample_chat

    if raw and system:
        raise RlcliError("--system needs the chat template; drop --raw or --system")
    text = _read_prompt(prompt)
    talker = _open(base_url, model, checkpoint, renderer, raw, max_tokens)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    model_input = talker.prompt(messages, text)
    settings = sample_chat.SamplingSettings(max_tokens, temperature, top_p, seed)
    future = talker.submit(model_input, settings, num_samples)
    try:
        replies = talker.replies(_wait(future, sys.stderr.isatty() and not as_json))
    except RlcliError:
        raise
    except Exception as e:
        raise sample_chat.sample_error(talker.target, e) from None
    if as_json:
        emit(
            {
                "model": talker.target.base_model,
                "checkpoint": talker.target.checkpoint,
                "renderer": None if raw else talker.renderer_name,
                "prompt_tokens": model_input.length,
                "samples": [r.as_json() for r in replies],
            },
            as_json=True,
        )
        return
    for i, reply in enumerate(replies, 1):
        if len(replies) > 1:
            sys.stdout.write(f"--- sample {i}/{len(replies)} ---\n")
        sys.stdout.write(reply.text + ("" if reply.text.endswith("\n") else "\n"))
    sys.stdout.flush()


HELP = "/reset forgets the conversation, /system TEXT sets the system message, /exit leaves"


def chat(
    model: str = MODEL,
    checkpoint: str = CHECKPOINT,
    system: str = SYSTEM,
    max_tokens: int = MAX_TOKENS,
    temperature: float = TEMPERATURE,
    top_p: float = TOP_P,
    seed: int = SEED,
    renderer: str = RENDERER,
    base_url: str = BASE_URL,
) -> None:
    """An interactive conversation in the terminal with a base model or a sampler checkpoint.

    Each turn re-renders the whole conversation with the model's chat template.

    /reset forgets the conversation; /system TEXT sets the system message (alone: clears it).

    /exit or Ctrl-D leaves; Ctrl-C cancels the answer being written.

    Answers stream as they are generated (the server's OpenAI-compatible endpoint, fed the same
    rendered prompt); on a server without one they appear whole.
    """
    from rlcli.client import sample_chat

    talker = _open(base_url, model, checkpoint, renderer, False, max_tokens)
    settings = sample_chat.SamplingSettings(max_tokens, temperature, top_p, seed)
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    info(f"{HELP}; Ctrl-C cancels an answer.")
    streaming = True
    history: list[dict] = []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            sys.stdout.write("\n")
            return
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            command, _, rest = line.partition(" ")
            if command in ("/exit", "/quit"):
                return
            if command == "/reset":
                history.clear()
                print("(conversation forgotten)")
            elif command == "/system":
                system = rest.strip() or None
                print(f"(system message: {system!r})" if system else "(no system message)")
            else:
                print(f"(unknown command {command}; {HELP})")
            continue
        turn = {"role": "user", "content": line}
        messages = ([{"role": "system", "content": system}] if system else []) + history + [turn]
        prompt = talker.prompt(messages)
        if streaming:
            try:
                text, reason = _stream_answer(talker, prompt, settings)
            except sample_chat.NoStreaming:
                streaming = False
                info(NO_STREAMING)
            except KeyboardInterrupt:  # leaving the stream hung up: the server drops the row
                print(" (cancelled)", flush=True)
                continue
            else:
                history += [turn, {"role": "assistant", "content": text}]
                continue
        future = talker.submit(prompt, settings)
        try:
            reply = talker.replies(_wait(future, sys.stderr.isatty()))[0]
        except KeyboardInterrupt:
            future.cancel()
            print("(cancelled)")
            continue
        except Exception as e:
            raise sample_chat.sample_error(talker.target, e) from None
        history += [turn, {"role": "assistant", "content": reply.text}]
        cut = " [cut at --max-tokens]" if reply.stop_reason == "length" else ""
        print(f"model> {reply.text}{cut}", flush=True)


def _stream_answer(talker, prompt, settings) -> tuple[str, str | None]:
    """Print ``model> `` and the answer as it arrives; (the whole text, finish reason)."""
    pieces, reason = [], None
    stream = talker.stream(prompt, settings)
    try:
        for piece, finish in stream:
            if not pieces:
                sys.stdout.write("model> ")
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
            reason = finish or reason
    finally:
        stream.close()
    if not pieces:
        sys.stdout.write("model> ")
    cut = " [cut at --max-tokens]" if reason == "length" else ""
    print(cut, flush=True)
    return "".join(pieces), reason

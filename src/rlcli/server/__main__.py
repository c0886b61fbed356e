"""``python -m rlcli.server``: run the torch backend in the foreground (what ``serve`` spawns)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from rlcli.checkpoint_format import parse_checkpoint_ttl
from rlcli.models.names import resolve_model_name

# Idle keep-alive connections stay open this long: longer than clients keep theirs (httpx's
# default, under the tinker SDK and openai: 5 s), so a client never sends a request on a
# connection the server is closing. At uvicorn's default, also 5 s, that race loses the
# request and the SDK waits out its 60 s timeout before retrying: the likely cause of an opsd
# step on CI whose request reached the engine 60 s late, then took milliseconds.
KEEP_ALIVE_S = 75


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlcli.server")
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction)
    parser.add_argument("--microbatch-tokens", type=_positive_int, default=None)
    parser.add_argument("--max-lora-rank", type=int, default=64)
    parser.add_argument("--checkpoints-dir", default="")
    parser.add_argument("--api-key", default=os.environ.get("RLCLI_SERVER_API_KEY"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--session-timeout", type=float, default=300.0)
    parser.add_argument("--max-sample-tokens", type=int, default=16384)
    parser.add_argument("--max-body-mb", type=_positive_float, default=256.0)
    parser.add_argument("--max-upload-gb", type=_positive_float, default=16.0)
    parser.add_argument("--checkpoint-ttl", type=_checkpoint_ttl, default="client")
    parser.add_argument("--capture", default=None, help="Capture /v1 exchanges into this folder.")
    parser.add_argument("--capture-tinker", action="store_true")
    parser.add_argument("--capture-redact", action="store_true")
    parser.add_argument("--capture-max-mb", type=_positive_float, default=256.0)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Compile the decode step with torch.compile (default: on a GPU only, or as "
        "RLCLI_COMPILE=0|1 says); --no-compile runs it eager.",
    )
    args = parser.parse_args(argv)

    import uvicorn

    from rlcli.server.http.app import create_app  # lazy: imports torch, transformers, tinker
    from rlcli.server.state.capture import CaptureError
    from rlcli.server.state.sessions import Settings  # lazy: imports torch, transformers, tinker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)}
    settings = Settings(**{**given, "base_model": resolve_model_name(args.base_model)})
    try:
        app = create_app(settings)
    except CaptureError as e:  # one line, before the engine starts (serve start shows it)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S
    )
    sys.exit(app.state.exit_code)  # non-zero when the engine died: supervisors restart us


def _checkpoint_ttl(text: str) -> str:
    try:
        parse_checkpoint_ttl(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


if __name__ == "__main__":
    main()

"""The ``torch`` backend: rlcli's own server, run as ``python -m rlcli.server``."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from rlcli.errors import RlcliError
from rlcli.launch import process
from rlcli.models.gguf import local_model
from rlcli.models.names import is_gguf_file, is_local_model, resolve_model_name


@dataclass
class TorchServerOptions:
    base_model: str
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"
    grad_checkpointing: bool | None = None  # None: the engine decides (engine.checkpoint_above)
    microbatch_tokens: int | None = None  # None: the device's default
    max_lora_rank: int = 64
    checkpoints_dir: str = ""
    api_key: str | None = None
    session_timeout: float = 300.0
    max_sample_tokens: int = 16384
    max_body_mb: float = 256.0
    max_upload_gb: float = 16.0
    compile: bool | None = None  # compile the decode step; None: the server's default (GPU: on)
    checkpoint_ttl: str = "client"  # checkpoint_format.parse_checkpoint_ttl
    capture: str | None = None  # the capture folder (None: capture off; docs/traces.md)
    capture_tinker: bool = False
    capture_redact: bool = False
    capture_max_mb: float = 256.0


def check_base_model(name: str, report=None) -> str:
    """A local model folder (resolved to an absolute path), a ``.gguf`` file (converted once
    into its cached folder, which is returned) or something shaped like a hub id."""
    if is_gguf_file(name):
        return local_model(name, report)
    if is_local_model(name):
        return resolve_model_name(name)
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        raise RlcliError(f"--base-model {name}: no such GGUF file")
    if path.exists():
        raise RlcliError(f"--base-model {name}: {path} has no config.json (not a model folder)")
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise RlcliError(
            f"--base-model {name}: no such folder, and not a hub id of the form org/name"
        )
    return name


def server_command(options: TorchServerOptions) -> list[str]:
    command = [
        sys.executable, "-m", "rlcli.server",
        "--base-model", options.base_model,
        "--host", options.host,
        "--port", str(options.port),
        "--device", options.device,
        "--dtype", options.dtype,
        "--max-lora-rank", str(options.max_lora_rank),
        "--session-timeout", str(options.session_timeout),
        "--max-sample-tokens", str(options.max_sample_tokens),
        "--max-body-mb", str(options.max_body_mb),
        "--max-upload-gb", str(options.max_upload_gb),
        "--checkpoint-ttl", options.checkpoint_ttl,
    ]  # fmt: skip
    if options.grad_checkpointing is not None:
        command.append(f"--{'' if options.grad_checkpointing else 'no-'}grad-checkpointing")
    if options.microbatch_tokens is not None:  # 0 is refused by the server, not taken as auto
        command += ["--microbatch-tokens", str(options.microbatch_tokens)]
    if options.checkpoints_dir:
        command += ["--checkpoints-dir", options.checkpoints_dir]
    if options.compile is not None:
        command.append(f"--{'' if options.compile else 'no-'}compile")
    if options.capture is not None:
        command += ["--capture", options.capture, "--capture-max-mb", str(options.capture_max_mb)]
        command += ["--capture-tinker"] * options.capture_tinker
        command += ["--capture-redact"] * options.capture_redact
    return command  # the API key travels in the environment (API_KEY_ENV), not in `ps`


API_KEY_ENV = "RLCLI_SERVER_API_KEY"


def start(
    home: Path, options: TorchServerOptions, *, wait: float
) -> tuple[process.ServerRecord, bool]:
    """Start our server detached under ``home`` (see ``process.start_detached``)."""
    return process.start_detached(home, launch(options), wait=wait)


def launch(options: TorchServerOptions) -> process.Launch:
    """Our server's command line, with the API key passed in its environment (not argv)."""
    return process.Launch(
        server_command(options),
        host=options.host,
        port=options.port,
        base_model=options.base_model,
        backend="torch",
        env={API_KEY_ENV: options.api_key} if options.api_key else {},
    )

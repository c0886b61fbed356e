"""``rlcli serve``: run a Tinker-API training server on this machine."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from dataclasses import fields
from pathlib import Path

import typer

from rlcli.checkpoint_format import CHECKPOINT_TTL_HELP, parse_checkpoint_ttl
from rlcli.cli._output import emit, info
from rlcli.errors import RlcliError

app = typer.Typer(help="Run a Tinker-API training server on this machine.", no_args_is_help=True)

BACKENDS = ("torch", "jax", "fsdp", "megatron")


def default_checkpoints_dir() -> Path:
    from rlcli.home import checkpoints_dir

    return checkpoints_dir()


def _home() -> Path:
    from rlcli.home import rlcli_home

    home = rlcli_home()
    home.mkdir(parents=True, exist_ok=True)
    return home


def _capture_options(home: Path, capture, folder, tinker: bool, redact: bool) -> dict:
    if not (capture or folder):
        for flag, value in (("--capture-tinker", tinker), ("--redact", redact)):
            if value:
                raise RlcliError(f"{flag}: only with --capture")
        return {"capture": None}
    if redact:
        import importlib.util

        if importlib.util.find_spec("presidio_analyzer") is None:
            raise RlcliError(
                "--redact needs Presidio, which is not installed: pip install 'rlcli[redact]'"
            )
    where = (folder or home / "traces").expanduser().resolve()
    return {"capture": str(where), "capture_tinker": tinker, "capture_redact": redact}


@app.command("start")
def start(
    ctx: typer.Context,
    base_model: str = typer.Option(
        ..., "--base-model", "-m", help="Hub id (org/name), a local model folder or a .gguf file."
    ),
    backend: str = typer.Option(
        "torch",
        help="torch (embedded, one device) | jax | fsdp | megatron (SkyRL; installed once).",
    ),
    host: str = typer.Option(
        "127.0.0.1",
        help="Address to bind; 0.0.0.0 exposes it to other machines (then --api-key, or "
        "--insecure).",
    ),
    port: int = typer.Option(8000, help="Port to listen on."),
    device: str = typer.Option("auto", help="auto | cpu | cuda."),
    dtype: str = typer.Option(
        "auto",
        help="auto | float32 | bfloat16 (auto: bf16 on a GPU with bf16 or a CPU with "
        "AVX512-BF16/AMX, else float32).",
    ),
    grad_checkpointing: bool | None = typer.Option(
        None,
        "--grad-checkpointing/--no-grad-checkpointing",
        help="Recompute activations in backward: far less memory, about 1.5x the step time. "
        "Default: always on a GPU; on a CPU only for a sequence longer than --microbatch-tokens.",
        show_default=False,
    ),
    microbatch_tokens: int | None = typer.Option(
        None,
        min=1,
        help="Padded tokens per forward/backward pass, which bounds activation memory "
        "(default: 4096 on a GPU; on a CPU 512 in float32, in bf16 up to 4096 as memory allows).",
        show_default=False,
    ),
    max_lora_rank: int = typer.Option(64, help="Largest LoRA rank a client may ask for."),
    compile: bool = typer.Option(
        None,
        "--compile/--no-compile",
        help="Compile the decode step with torch.compile, once per batch size when first used "
        "(default: on a GPU; on a CPU it gained 5-10% a step for 20-40 s of compiling each).",
        show_default=False,
    ),
    checkpoints_dir: Path = typer.Option(
        None, help="Where checkpoints live (default $RLCLI_HOME/checkpoints)."
    ),
    checkpoint_ttl: str = typer.Option(
        "client", help=CHECKPOINT_TTL_HELP, envvar="RLCLI_CHECKPOINT_TTL"
    ),
    api_key: str = typer.Option(
        None, help="Accept only this X-API-Key (default: any key).", envvar="RLCLI_SERVER_API_KEY"
    ),
    session_timeout: float = typer.Option(
        300, help="Free a client's adapters after this many seconds without a heartbeat."
    ),
    max_sample_tokens: int = typer.Option(
        16384, help="The most tokens one sample request may ask for (longer ones are refused)."
    ),
    max_body_mb: float = typer.Option(
        256,
        min=0.001,
        help="Refuse (413) a request body larger than this many MiB, before "
        "reading it (restore uploads: --max-upload-gb).",
    ),
    max_upload_gb: float = typer.Option(
        16, min=0.000001, help="Refuse (413) a restore upload larger than this many GiB."
    ),
    capture: bool = typer.Option(
        False, "--capture", help="Record every /v1 exchange as a JSON line (docs/traces.md)."
    ),
    capture_dir: Path = typer.Option(
        None, help="Where --capture writes (default $RLCLI_HOME/traces); implies --capture."
    ),
    capture_tinker: bool = typer.Option(
        False, "--capture-tinker", help="With --capture: Tinker sample requests too."
    ),
    redact: bool = typer.Option(
        False, "--redact", help="With --capture: take PII out of each record before it is written."
    ),
    capture_max_mb: float = typer.Option(
        256, min=0.1, help="With --capture: start a new capture file past this many MiB."
    ),
    wait: float = typer.Option(
        300, help="Seconds to wait for the server to become healthy; then stop it and fail."
    ),
    foreground: bool = typer.Option(
        False, "--foreground", help="Run in this process (for containers and process managers)."
    ),
    gpus: int = typer.Option(None, help="SkyRL fsdp/megatron: GPUs per node."),
    nodes: int = typer.Option(None, help="SkyRL fsdp/megatron: nodes (a Ray cluster)."),
    tp: int = typer.Option(None, help="SkyRL fsdp/megatron: tensor-parallel GPUs per engine."),
    max_model_len: int = typer.Option(None, help="SkyRL fsdp/megatron: vLLM's max_model_len."),
    ray_address: str = typer.Option(
        None, help="SkyRL fsdp/megatron: join this Ray cluster (default: a local Ray)."
    ),
    backend_config: str = typer.Option(
        None, help="SkyRL: JSON merged last into SkyRL's --backend-config."
    ),
    insecure: bool = typer.Option(
        False, "--insecure", help="Allow a --host other machines reach without an API key."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the commands and configuration; start nothing."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Start a server in the background, wait until it is healthy and print its base URL."""
    from rlcli.launch import process
    from rlcli.launch import torch_server as torch_backend

    if backend not in BACKENDS:
        raise RlcliError(f"--backend {backend}: unknown backend; choose from {', '.join(BACKENDS)}")
    process.check_port(port)
    try:
        parse_checkpoint_ttl(checkpoint_ttl)
    except ValueError as e:
        raise RlcliError(f"--checkpoint-ttl {checkpoint_ttl}: {e}") from None
    process.check_exposure(host, api_key, insecure, takes_key=backend == "torch")
    if compile is not None and backend != "torch":
        flag = "--compile" if compile else "--no-compile"
        raise RlcliError(f"{flag}: only for --backend torch (SkyRL's vLLM compiles its own)")
    if (capture or capture_dir) and backend != "torch":
        raise RlcliError("--capture: only for --backend torch (rlcli's own server)")
    if backend != "torch":
        _start_skyrl(
            backend, base_model, host, port, device=device, dtype=dtype, api_key=api_key,
            max_lora_rank=max_lora_rank, checkpoints_dir=checkpoints_dir,
            session_timeout=session_timeout, checkpoint_ttl=checkpoint_ttl, gpus=gpus,
            nodes=nodes, tp=tp, max_model_len=max_model_len, ray_address=ray_address,
            backend_config=backend_config,
            wait=wait, foreground=foreground, dry_run=dry_run, as_json=as_json,
        )  # fmt: skip
        return
    for flag, value in (
        ("--gpus", gpus), ("--nodes", nodes), ("--tp", tp), ("--max-model-len", max_model_len),
        ("--ray-address", ray_address), ("--backend-config", backend_config),
    ):  # fmt: skip
        if value is not None:
            raise RlcliError(f"{flag}: only for the SkyRL backends (--backend jax|fsdp|megatron)")
    for flag, value, choices in (
        ("--device", device, ("auto", "cpu", "cuda")),
        ("--dtype", dtype, ("auto", "float32", "bfloat16")),
    ):
        if value not in choices:
            raise RlcliError(f"{flag} {value}: choose from {', '.join(choices)}")
    if api_key and not api_key.startswith("tml-"):
        raise RlcliError("--api-key: tinker clients only send keys that start with 'tml-'")
    home = _home()
    # Every flag named like a field of the server's options goes to it as given.
    same = {
        f.name: ctx.params[f.name]
        for f in fields(torch_backend.TorchServerOptions)
        if not f.name.startswith("capture")  # resolved below
    }
    checkpoints = (checkpoints_dir or default_checkpoints_dir()).expanduser().resolve()
    resolved = {
        "base_model": torch_backend.check_base_model(base_model),
        "checkpoints_dir": str(checkpoints),
        **_capture_options(home, capture, capture_dir, capture_tinker, redact),
    }
    options = torch_backend.TorchServerOptions(**{**same, **resolved})
    launch = torch_backend.launch(options)
    if dry_run:
        emit({"backend": backend, "command": shlex.join(launch.command)}, as_json=as_json)
        return
    if foreground:
        info(f"serving {options.base_model} on {host}:{port} in the foreground (pid {os.getpid()})")
        info(f"OpenAI-compatible API: http://{host}:{port}/v1")
        code = process.run_foreground(home, launch)
        if code < 0:  # the server died of a signal: end the same way, as a supervisor expects
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        raise typer.Exit(code)
    info(f"starting the {backend} server for {options.base_model} on {host}:{port} ...")
    # Raises, leaving nothing running, unless the server becomes healthy within --wait.
    record, _ = process.start_detached(home, launch, wait=wait)
    result = {"base_url": record.base_url, "pid": record.pid, "healthy": True}
    result["openai_base_url"] = f"{record.base_url}/v1"
    result["log"] = record.log_path
    if as_json:
        emit(result, as_json=True)
    else:
        info(f"ready (pid {record.pid}); logs: rlcli serve logs; stop: rlcli serve stop")
        info(f"Tinker API: {record.base_url}  OpenAI-compatible API: {record.base_url}/v1")
        print(record.base_url)


def _start_skyrl(backend: str, base_model: str, host: str, port: int, **flags) -> None:
    """``serve start --backend jax|fsdp|megatron``: SkyRL's server (``launch/skyrl.py``)."""
    from rlcli.launch import skyrl
    from rlcli.launch import torch_server as torch_backend

    for flag, value, default in (
        ("--device", flags["device"], "auto"),
        ("--dtype", flags["dtype"], "auto"),
        ("--api-key", flags["api_key"], None),
        ("--checkpoint-ttl", flags["checkpoint_ttl"], "client"),
    ):
        if value != default:
            raise RlcliError(f"{flag}: only for --backend torch (SkyRL sets its own)")
    home = _home()
    options = skyrl.SkyRLOptions(
        backend=backend,
        base_model=torch_backend.check_base_model(base_model),
        host=host,
        port=port,
        gpus=flags["gpus"],
        nodes=flags["nodes"],
        tp=flags["tp"],
        max_model_len=flags["max_model_len"],
        max_lora_rank=flags["max_lora_rank"],
        session_timeout=flags["session_timeout"],
        ray_address=flags["ray_address"],
        backend_config=skyrl.parse_backend_config(flags["backend_config"]),
        checkpoints_dir=str(
            (flags["checkpoints_dir"] or home / "skyrl" / "checkpoints").expanduser().resolve()
        ),
        database=str(home / "skyrl" / "tinker.db"),
    )
    result = skyrl.start(
        home, options, wait=flags["wait"], foreground=flags["foreground"],
        dry_run=flags["dry_run"], say=info,
    )  # fmt: skip
    if result is None:
        return
    if flags["dry_run"]:
        emit(result, as_json=True)  # nested commands and config: JSON for people and scripts
    elif flags["as_json"]:
        emit(result, as_json=True)
    else:
        info("ready (pid {pid}); logs: rlcli serve logs; stop: rlcli serve stop".format(**result))
        print(result["base_url"])


@app.command("stop")
def stop(
    grace: float = typer.Option(15, help="Seconds to wait after SIGTERM before SIGKILL."),
) -> None:
    """Stop the running server: gracefully, then forced."""
    from rlcli.launch import process

    record, how = process.stop(_home(), grace=grace)
    if how == "not running":
        info("no server is running; nothing to stop")
    elif how == "stale":
        info(
            f"no server is running (cleaned up the stale record of pid {record.pid}, which "
            "has exited or is now another process; nothing was signalled)"
        )
    else:
        info(f"{how} the server (pid {record.pid}, {record.base_url})")


@app.command("status")
def status(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Is a server running here? Health, pid, port, model, backend, uptime.

    Exit code 0: running and healthy; 1: running but not healthy; 3: not running."""
    import httpx

    from rlcli.client import endpoint
    from rlcli.launch import process

    record, stale = process.live_record(_home())
    if record is None:
        result = {"running": False}
        if stale:  # it died on its own: say why, from its part of the log
            result["cleaned_up_stale_pid"] = stale.pid
            log = Path(stale.log_path)
            error = process.last_error_line(log, process.last_start_offset(log), fallback=False)
            if error:
                result["last_error"] = error
        emit(result, as_json=as_json)
        if not as_json:
            info(
                "no server is running here; start one: rlcli serve start --base-model MODEL "
                "(a hub id, a model folder or a .gguf file)"
            )
        raise typer.Exit(3)  # like `systemctl status`: 3 means not running
    healthy, detail = process.health(record.base_url)
    result = {
        "running": True,
        "healthy": healthy,
        "detail": detail,
        "pid": record.pid,
        "base_url": record.base_url,
        "port": record.port,
        "base_model": record.base_model,
        "backend": record.backend,
        "uptime_s": round(time.time() - record.started_at, 1),
        "log": record.log_path,
    }
    try:
        answer = httpx.get(f"{record.base_url}/rlcli/status", headers=endpoint.headers(), timeout=2)
        answer.raise_for_status()  # SkyRL has no such route: its status says what process knows
        server = answer.json()
        engine = server.get("engine") or {}
        result.update(
            device=engine.get("device"),
            dtype=engine.get("dtype"),
            decode_step=engine.get("decode_step"),
            compile=engine.get("compile"),
            compile_seconds=engine.get("compile_seconds"),
            training_clients=server.get("models"),
            pending_requests=server.get("pending_requests"),
        )
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    emit(result, as_json=as_json)
    if not healthy:
        raise typer.Exit(1)


@app.command("logs")
def logs(
    lines: int = typer.Option(50, "-n", "--lines", help="How many lines from the end."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
) -> None:
    """Print the server log."""
    from rlcli.launch import process

    path = process.log_path(_home())
    if not path.exists():
        raise RlcliError(f"no server log yet at {path}; start one with `rlcli serve start`")
    for line in process.tail(path, lines):
        print(line)
    if not follow:
        return
    with path.open(errors="replace") as f:
        f.seek(0, os.SEEK_END)
        while True:
            line = f.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
            else:
                time.sleep(0.3)

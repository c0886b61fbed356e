"""The SkyRL backends (``jax``, ``fsdp``, ``megatron``): SkyRL 0.4.0's Tinker server, installed
once in its own environment and started the way it must be (under ``uv run``).

SkyRL needs Python >= 3.12 and transformers >= 5.6, so it cannot share rlcli's venv: it gets a
uv venv under ``$RLCLI_HOME/backends`` (or ``$RLCLI_SKYRL_CACHE``), one per backend, reused once
complete. Its API process starts the engine with ``uv run <its own uv flags> -m
skyrl.tinker.engine``, so it must be launched under ``uv run`` with ``uv`` on its PATH. SkyRL's
defaults are unsafe for us (``--host 0.0.0.0``, its database inside site-packages, checkpoints in
/tmp, the megatron backend): every one is set explicitly. ``serve status | logs | stop`` see it
through the same record as the torch backend (``process.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlcli.errors import RlcliError
from rlcli.launch import process

SKYRL_VERSION = "0.4.0"
BACKENDS = ("jax", "fsdp", "megatron")
GPU_BACKENDS = ("fsdp", "megatron")
# Packages SkyRL imports without declaring them (the API imports aiohttp).
UNDECLARED = ("aiohttp",)
CACHE_ENV = "RLCLI_SKYRL_CACHE"
READY_MARK = "rlcli-installed.json"
ENGINE_READY = "Initialized TinkerEngine"  # the engine's log line once its model is loaded


@dataclass
class SkyRLOptions:
    backend: str
    base_model: str
    host: str = "127.0.0.1"
    port: int = 8000
    gpus: int | None = None  # per node
    nodes: int | None = None
    tp: int | None = None
    max_model_len: int | None = None
    max_lora_rank: int | None = None
    session_timeout: float = 300.0
    ray_address: str | None = None
    backend_config: dict = field(default_factory=dict)  # --backend-config, merged last
    checkpoints_dir: str = ""
    database: str = ""


# ---- prerequisites (checked before anything is downloaded) ----------------------------------


def find_uv(dirs: list[str] | None = None) -> str:
    """``uv`` on PATH, else beside this Python (rlcli depends on the ``uv`` package)."""
    if dirs is None:
        dirs = [*os.environ.get("PATH", "").split(os.pathsep), str(Path(sys.executable).parent)]
    for folder in dirs:
        candidate = Path(folder) / "uv"
        if folder and candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RlcliError(
        "the SkyRL backends need uv, which was not found on PATH or beside this Python: "
        "pip install 'uv>=0.5' (or see https://docs.astral.sh/uv/)"
    )


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
        major, minor = out.split()
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def find_python() -> str:
    """A Python >= 3.12 on this machine (uv cannot download one offline): PATH first, then
    pyenv's versions (``$PYENV_ROOT`` or ``~/.pyenv``), oldest suitable first."""
    names = ["python3.12", "python3.13", "python3.14", "python3"]  # 3.12: what SkyRL tests
    candidates = [found for name in names if (found := shutil.which(name))]
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    if pyenv.is_dir():
        candidates += [str(p) for p in sorted(pyenv.glob("3.1[2-9]*/bin/python3"))]
    for candidate in candidates:
        version = _version(candidate)
        if version and version >= (3, 12):
            return str(Path(candidate).resolve())
    raise RlcliError(
        f"SkyRL {SKYRL_VERSION} needs Python 3.12 or newer, and none was found on PATH or under "
        f"{pyenv}: install one (e.g. `pyenv install 3.12` or your package manager's python3.12)"
    )


def cuda_present() -> bool:
    """An NVIDIA driver is here (what SkyRL's Ray/vLLM path needs): a device node or nvidia-smi."""
    return (
        Path("/proc/driver/nvidia/version").exists()
        or any(Path("/dev").glob("nvidia[0-9]*"))
        or shutil.which("nvidia-smi") is not None
    )


def check_cuda(backend: str) -> None:
    if backend in GPU_BACKENDS and not cuda_present():
        raise RlcliError(
            f"--backend {backend} needs NVIDIA GPUs with the CUDA driver (SkyRL runs it on Ray + "
            "vLLM), and none was found here (no /dev/nvidia*, no nvidia-smi): install the NVIDIA "
            "driver, or use --backend jax (runs on CPU) or torch"
        )


# ---- options -> SkyRL configuration ----------------------------------------------------------


def parse_backend_config(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RlcliError(
            f"--backend-config: not valid JSON ({e.msg} at column {e.colno})"
        ) from None
    if not isinstance(value, dict):
        raise RlcliError('--backend-config: expected a JSON object, e.g. {"max_lora_adapters": 8}')
    return value


def check_flags(options: SkyRLOptions) -> None:
    """Flags that do not apply to the chosen backend, or do not fit together: one line each."""
    if options.backend == "jax":
        for flag, value in (
            ("--gpus", options.gpus),
            ("--nodes", options.nodes),
            ("--tp", options.tp),
            ("--max-model-len", options.max_model_len),
            ("--ray-address", options.ray_address),
        ):
            if value is not None:
                raise RlcliError(
                    f"{flag}: not used by --backend jax (one process; JAX places the model "
                    "itself); set JAX options with --backend-config, or use --backend fsdp or "
                    "megatron for GPUs and nodes"
                )
        return
    for flag, value in (
        ("--gpus", options.gpus),
        ("--nodes", options.nodes),
        ("--tp", options.tp),
        ("--max-model-len", options.max_model_len),
    ):
        if value is not None and value < 1:
            raise RlcliError(f"{flag} {value}: must be at least 1")
    gpus = (options.gpus or 1) * (options.nodes or 1)
    tp = options.tp or 1
    if gpus % tp:
        raise RlcliError(
            f"--tp {tp}: the {gpus} GPUs (--gpus x --nodes) must split into whole inference "
            "engines of --tp GPUs each"
        )


def backend_config(options: SkyRLOptions) -> dict:
    """SkyRL's ``--backend-config``: rlcli's settings, then ``--backend-config`` merged last.

    jax: ``JaxBackendConfig`` fields. fsdp/megatron: dotted SkyRL-Train overrides. SkyRL
    colocates training and inference on the same GPUs (``trainer.placement.colocate_all``), so
    the GPUs given (per node x nodes) hold the policy, the reference model and
    ``gpus x nodes / tp`` vLLM engines of ``tp`` GPUs each."""
    config: dict = {}
    if options.backend == "jax":
        if options.max_lora_rank is not None:
            config["max_lora_rank"] = options.max_lora_rank
    else:
        gpus, nodes, tp = options.gpus or 1, options.nodes or 1, options.tp or 1
        config.update(
            {
                "trainer.placement.policy_num_gpus_per_node": gpus,
                "trainer.placement.policy_num_nodes": nodes,
                "trainer.placement.ref_num_gpus_per_node": gpus,
                "trainer.placement.ref_num_nodes": nodes,
                "generator.inference_engine.num_engines": gpus * nodes // tp,
                "generator.inference_engine.tensor_parallel_size": tp,
            }
        )
        if options.backend == "megatron":
            config["trainer.policy.megatron_config.tensor_model_parallel_size"] = tp
        if options.max_model_len is not None:
            key = "generator.inference_engine.engine_init_kwargs.max_model_len"
            config[key] = options.max_model_len
    config.update(options.backend_config)
    return config


# ---- the environment -------------------------------------------------------------------------


def env_root(home: Path) -> Path:
    """Where SkyRL environments (and uv's download cache) live: ``$RLCLI_SKYRL_CACHE`` (CI and
    tests keep one across throwaway homes) or ``$RLCLI_HOME/backends``."""
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser().resolve() if override else home / "backends"


def env_dir(home: Path, backend: str) -> Path:
    return env_root(home) / f"skyrl-{SKYRL_VERSION}-{backend}"


def requirement(backend: str) -> str:
    return f"skyrl[{backend},tinker]=={SKYRL_VERSION}"


def install_commands(uv: str, python: str, venv: Path, backend: str) -> list[list[str]]:
    return [
        [uv, "venv", "--python", python, str(venv)],
        [uv, "pip", "install", "--python", str(venv / "bin" / "python"), requirement(backend),
         *UNDECLARED],
    ]  # fmt: skip


def uv_env(home: Path) -> dict[str, str]:
    return {"UV_CACHE_DIR": str(env_root(home) / "uv-cache")}


def installed(home: Path, backend: str) -> bool:
    return (env_dir(home, backend) / READY_MARK).exists()


def ensure_env(home: Path, backend: str, uv: str, python: str, say=print) -> Path:
    """The backend's venv, installed now if missing (a half-made one is removed first). Returns
    the venv's Python. Several GB the first time (jax and a CUDA torch build from PyPI)."""
    venv = env_dir(home, backend)
    if installed(home, backend):
        return venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with (venv.parent / f".{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rlcli may be installing the same env
        if installed(home, backend):
            return venv / "bin" / "python"
        shutil.rmtree(venv, ignore_errors=True)
        say(
            f"installing SkyRL {SKYRL_VERSION} ({backend}) into {venv} (once; several GB, "
            "a few minutes) ..."
        )
        started = time.monotonic()
        env = {**os.environ, **uv_env(home)}
        for command in install_commands(uv, python, venv, backend):
            result = subprocess.run(command, env=env, stdout=sys.stderr, stderr=subprocess.STDOUT)
            if result.returncode != 0:
                shutil.rmtree(venv, ignore_errors=True)
                raise RlcliError(
                    f"installing SkyRL failed (exit {result.returncode}): {shlex.join(command)}"
                )
        seconds = round(time.monotonic() - started, 1)
        mark = {"requirement": requirement(backend), "python": python, "seconds": seconds}
        (venv / READY_MARK).write_text(json.dumps(mark) + "\n")
        say(f"installed SkyRL {SKYRL_VERSION} ({backend}) in {seconds:g}s")
    return venv / "bin" / "python"


# ---- the server ------------------------------------------------------------------------------


def server_command(options: SkyRLOptions, uv: str, venv_python: str) -> list[str]:
    """``uv run --no-project --python <venv python> -m skyrl.tinker.api ...``: SkyRL's API reads
    its parent's ``uv run`` flags to start the engine the same way."""
    return [
        uv, "run", "--no-project", "--python", venv_python,
        "-m", "skyrl.tinker.api",
        "--host", options.host,
        "--port", str(options.port),
        "--base-model", options.base_model,
        "--backend", options.backend,
        "--backend-config", json.dumps(backend_config(options), sort_keys=True),
        "--checkpoints-base", options.checkpoints_dir,
        "--database-url", f"sqlite:///{options.database}",
        "--session-timeout-sec", str(max(1, round(options.session_timeout))),
    ]  # fmt: skip


def server_env(home: Path, options: SkyRLOptions, uv: str) -> dict[str, str]:
    """uv first on PATH (the API runs ``uv run`` for its engine), uv's cache, offline uv (the
    venv is complete), and the Ray cluster to join (``ray.init()`` reads ``RAY_ADDRESS``;
    without it the fsdp/megatron engine starts a local Ray inside the server's process tree)."""
    env = {
        "PATH": os.pathsep.join([str(Path(uv).parent), os.environ.get("PATH", "")]),
        "UV_OFFLINE": "1",
        "COLUMNS": "200",  # SkyRL logs through rich, which wraps lines at 80 columns in a file
        **uv_env(home),
    }
    if options.ray_address:
        env["RAY_ADDRESS"] = options.ray_address
    return env


def ray_plan(options: SkyRLOptions) -> str:
    if options.backend not in GPU_BACKENDS:
        return "not used"
    if options.ray_address:
        return f"joins the cluster at {options.ray_address}"
    return "a local Ray, started by the engine and stopped with the server"


def plan(home: Path, options: SkyRLOptions, uv: str, python: str) -> dict:
    """What ``serve start`` would do, for ``--dry-run``: the commands, their environment, the
    merged backend configuration."""
    venv = env_dir(home, options.backend)
    venv_python = str(venv / "bin" / "python")
    result = {
        "backend": options.backend,
        "skyrl": requirement(options.backend),
        "environment": str(venv),
        "installed": installed(home, options.backend),
        "install_commands": [
            shlex.join(c) for c in install_commands(uv, python, venv, options.backend)
        ],
        "command": shlex.join(server_command(options, uv, venv_python)),
        "env": {k: v for k, v in server_env(home, options, uv).items() if k != "PATH"},
        "backend_config": backend_config(options),
        "ray": ray_plan(options),
    }
    if options.backend in GPU_BACKENDS and not cuda_present():
        result["note"] = f"no CUDA here: a real start of --backend {options.backend} would refuse"
    return result


def wait_for_engine(home: Path, record: process.ServerRecord, wait: float) -> None:
    """SkyRL's API answers health at once; the engine loads the model in its own process. Wait
    for its ready line in the log, or fail (stopping the server) if the API exits or time runs
    out."""
    log = Path(record.log_path)
    offset = process.last_start_offset(log)
    deadline = time.monotonic() + wait
    while True:
        with contextlib.suppress(OSError), log.open("rb") as f:
            f.seek(offset)
            if ENGINE_READY.encode() in f.read():
                return
        alive = process.is_ours(record)
        if not alive or time.monotonic() >= deadline:
            error = process.last_error_line(log, offset)
            process.stop(home, grace=5)
            why = "the SkyRL engine exited while loading" if not alive else (
                f"the SkyRL engine did not load the model within --wait {wait:g}s"
            )  # fmt: skip
            raise RlcliError(f"{why}: {error} (log: {log})")
        time.sleep(0.5)


def start(
    home: Path,
    options: SkyRLOptions,
    *,
    wait: float,
    foreground: bool,
    dry_run: bool,
    say: Callable[[str], None] = print,
) -> dict | None:
    """``serve start`` for a SkyRL backend. Every check that needs no download comes first
    (flags, uv, Python, CUDA, a server already here, the port); then the environment (installed
    once), then the server, detached until its engine has loaded the model, or in the
    foreground. Returns the plan (dry run) or the started server's summary (None after a
    foreground run, whose exit code is raised as ``SystemExit``). ``say`` hears what it is
    doing (the CLI's stderr lines)."""
    check_flags(options)
    uv, python = find_uv(), find_python()
    if dry_run:
        return plan(home, options, uv, python)
    check_cuda(options.backend)
    running, _ = process.live_record(home)
    if running is not None:
        raise RlcliError(
            f"a server is already running here (pid {running.pid}, {running.base_url}); "
            "stop it with `rlcli serve stop`"
        )
    process.check_port_free(options.host, options.port)
    venv_python = str(ensure_env(home, options.backend, uv, python, say=say))
    Path(options.database).parent.mkdir(parents=True, exist_ok=True)
    Path(options.checkpoints_dir).mkdir(parents=True, exist_ok=True)
    command = server_command(options, uv, venv_python)
    env = server_env(home, options, uv)
    where = f"{options.host}:{options.port}"
    launch = process.Launch(
        command, options.host, options.port, options.base_model, options.backend, env
    )
    if foreground:
        say(f"serving {options.base_model} with SkyRL {options.backend} on {where}")
        code = process.run_foreground(home, launch)
        raise SystemExit(code if code >= 0 else 128 - code)
    say(f"starting SkyRL {options.backend} for {options.base_model} on {where} ...")
    started = time.monotonic()
    record, _ = process.start_detached(home, launch, wait=wait)
    wait_for_engine(home, record, max(1.0, wait - (time.monotonic() - started)))
    process.remember_family(home, record)  # the engine and Ray's workers, now they exist
    return {"base_url": record.base_url, "pid": record.pid, "healthy": True, "log": record.log_path}

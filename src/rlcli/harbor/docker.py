"""A sandbox on the local Docker daemon, for the cookbook's ``recipes/harbor_rl``.

``DockerSandbox`` has the cookbook's ``SandboxInterface`` (``sandbox_id``, ``send_heartbeat``,
``run_command``, ``read_file``, ``write_file``, ``cleanup``) and drives the ``docker`` CLI:

- the image is the task's prebuilt ``docker_image`` when the daemon has it, else built from the
  task's ``environment/`` and tagged by a hash of that folder's contents (an edited Dockerfile
  or file rebuilds; an unchanged one is reused);
- one container per rollout (``docker run -d --rm``), held to the task's CPUs and memory (swap
  included), with no network unless the task sets ``allow_internet``, a pid limit, and a main
  process that ends by itself after the environment timeout (so even a container whose owner
  was SIGKILLed goes away then);
- each command runs under ``timeout`` inside the container (its whole process group is
  killed), and a command past its timeout is answered with exit code 124 and a line saying so,
  which the model sees; stdout and stderr are capped;
- every container carries the labels ``rlcli.harbor=1`` and ``rlcli.harbor.run=<run id>``,
  and is removed by ``cleanup``, at exit (``atexit``), on SIGTERM, and by the parent ``rlcli``
  process after the recipe ends (``remove_run_containers``), whatever way it ended.

The daemon is ``$DOCKER_HOST``, else the one ``.ci/docker-up.sh`` starts
(``/var/lib/rlcli-docker/docker.sock``) when it is there, else Docker's default socket.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import json
import os
import re
import subprocess
import threading
import time
import uuid
from pathlib import Path

from rlcli.errors import RlcliError
from rlcli.files.lastline import last_line
from rlcli.harbor.tasks import TaskSpec

LABEL = "rlcli.harbor"
RUN_LABEL = "rlcli.harbor.run"
RLCLI_SOCKET = Path(os.environ.get("RLCLI_DOCKER_ROOT") or "/var/lib/rlcli-docker") / "docker.sock"
SYSTEM_SOCKET = Path("/var/run/docker.sock")
DEFAULT_OUTPUT_BYTES = 128 * 1024
PIDS_LIMIT = 1024
TIMEOUT_EXIT = 124
STATS_FILE = "harbor_sandbox.jsonl"  # per container: start, commands, time (in the run folder)


def docker_env() -> dict[str, str]:
    """The environment for ``docker`` commands: ``DOCKER_HOST`` as found (see the docstring)."""
    env = dict(os.environ)
    if not env.get("DOCKER_HOST") and RLCLI_SOCKET.exists():
        env["DOCKER_HOST"] = f"unix://{RLCLI_SOCKET}"
    return env


def where() -> str:
    """The daemon ``docker`` commands talk to."""
    return docker_env().get("DOCKER_HOST") or f"unix://{SYSTEM_SOCKET}"


def docker(*args: str, timeout: float = 60, stdin: bytes | None = None, check: bool = True):
    """Run ``docker ARGS`` (sync); ``RlcliError`` with docker's last line when ``check``."""
    try:
        done = subprocess.run(
            ["docker", *args],
            input=stdin,
            capture_output=True,
            timeout=timeout,
            env=docker_env(),
        )
    except FileNotFoundError:
        raise RlcliError(
            "--sandbox docker: the `docker` command is not installed (apt-get install docker.io)"
        ) from None
    except subprocess.TimeoutExpired:
        raise RlcliError(f"docker {args[0]}: no answer from the daemon in {timeout:.0f}s") from None
    if check and done.returncode != 0:
        raise RlcliError(f"docker {args[0]} failed: {_last_line(done.stderr)}")
    return done


def _last_line(raw: bytes) -> str:
    return last_line(raw) or "no output"


def check_daemon() -> str:
    """The daemon's version; one clear line when no daemon answers."""
    done = docker("version", "--format", "{{.Server.Version}}", timeout=15, check=False)
    if done.returncode != 0:
        raise RlcliError(
            f"--sandbox docker: no Docker daemon answers at {where()} "
            f"({_last_line(done.stderr)}); start one (e.g. sudo .ci/docker-up.sh, or dockerd), "
            "or point DOCKER_HOST at it"
        )
    return done.stdout.decode().strip()


# ---- images ---------------------------------------------------------------------------------


def environment_hash(folder: Path) -> str:
    """A hash of every file's relative path, mode bit and content under ``folder``."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(b"x" if os.access(path, os.X_OK) else b"-")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def image_tag(task: TaskSpec) -> str:
    """``rlcli-harbor/<task>:<hash of environment/>``: the tag of the image built from it."""
    name = re.sub(r"[^a-z0-9_.-]+", "-", task.name.lower()).strip("-._") or "task"
    return f"rlcli-harbor/{name}:{environment_hash(task.environment)}"


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, timeout=30, check=False).returncode == 0


def has_dockerfile(task: TaskSpec) -> bool:
    return (task.environment / "Dockerfile").is_file()


def needs_build(task: TaskSpec) -> bool:
    """Whether ``ensure_image`` would build (no prebuilt image here, no built one either)."""
    if task.docker_image and image_exists(task.docker_image):
        return False
    return has_dockerfile(task) and not image_exists(image_tag(task))


def ensure_image(task: TaskSpec, build_timeout: float = 1800) -> tuple[str, bool]:
    """(tag, built now): the task's prebuilt ``docker_image`` when this daemon has it (no
    registry may be reachable), else the image built from ``environment/`` (reused while the
    folder's contents hash the same)."""
    if task.docker_image and image_exists(task.docker_image):
        return task.docker_image, False
    if not has_dockerfile(task):
        raise RlcliError(
            f"task {task.folder}: image {task.docker_image} (task.toml docker_image) is not on "
            "this Docker daemon and there is no environment/Dockerfile to build; load it first "
            "(docker load) or pull it where a registry is reachable"
        )
    tag = image_tag(task)
    if image_exists(tag):
        return tag, False
    done = docker(
        "build", "-q", "--force-rm", "-t", tag, "--label", f"{LABEL}=1", str(task.environment),
        timeout=build_timeout, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RlcliError(
            f"task {task.folder}: docker build of environment/ failed: {_last_line(done.stderr)}"
        )
    return tag, True


# ---- cleanup --------------------------------------------------------------------------------

_LIVE: set[str] = set()  # containers this process started and has not removed
_LIVE_LOCK = threading.Lock()


def remove_containers(ids: list[str]) -> None:
    if ids:
        docker("rm", "-f", "-v", *ids, timeout=60, check=False)


def run_containers(run_id: str) -> list[str]:
    """Containers (running or not) labelled with ``run_id``."""
    done = docker("ps", "-aq", "--filter", f"label={RUN_LABEL}={run_id}", timeout=30, check=False)
    return done.stdout.decode().split() if done.returncode == 0 else []


def remove_run_containers(run_id: str) -> int:
    """Remove every container of run ``run_id``; how many there were. Never raises."""
    try:
        ids = run_containers(run_id)
        remove_containers(ids)
        return len(ids)
    except (RlcliError, OSError):
        return 0


def remove_live_containers() -> None:
    """This process's containers, removed (atexit and signal paths)."""
    with _LIVE_LOCK:
        ids = sorted(_LIVE)
        _LIVE.clear()
    with contextlib.suppress(RlcliError, OSError):
        remove_containers(ids)


atexit.register(remove_live_containers)


# ---- the sandbox ----------------------------------------------------------------------------


async def _exec(
    argv: list[str], stdin: bytes | None, timeout: float, cap: int, finish_on_cancel: float = 0
) -> tuple[int | None, bytes, bytes, bool, bool]:
    """(exit code or None on timeout, stdout, stderr, truncated, timed out) of ``docker ARGV``,
    each stream capped at ``cap`` bytes (the rest is read and dropped). Cancelled (Ctrl-C),
    the client is given ``finish_on_cancel`` seconds to end (what it was making exists by
    then, so it can be removed), then killed."""
    proc = await asyncio.create_subprocess_exec(
        "docker",
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=docker_env(),
    )
    truncated = False

    async def read(stream) -> bytes:
        nonlocal truncated
        kept = bytearray()
        while chunk := await stream.read(65536):
            room = cap - len(kept)
            if len(chunk) > room:
                truncated = True
            kept += chunk[: max(room, 0)]
        return bytes(kept)

    async def feed() -> None:
        if stdin is not None and proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            proc.stdin.close()

    gathered = asyncio.gather(read(proc.stdout), read(proc.stderr), feed(), proc.wait())
    try:
        out, err, _, code = await asyncio.wait_for(gathered, timeout)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), finish_on_cancel)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), 5)
        return None, b"", b"", truncated, True
    return code, out, err, truncated, False


class DockerSandbox:
    """One container for one rollout (see the module docstring)."""

    def __init__(self, container: str, task: TaskSpec, stats: dict) -> None:
        self._id = container
        self.task = task
        self.stats = stats
        self._removed = False

    @classmethod
    async def create(
        cls, task: TaskSpec, run_id: str, image: str, lifetime_s: int
    ) -> DockerSandbox:
        started = time.monotonic()
        name = f"rlcli-harbor-{run_id[:12]}-{uuid.uuid4().hex[:8]}"
        cpus = min(task.cpus, float(os.cpu_count() or 1))
        argv = [
            "run", "-d", "--rm", "--name", name,
            "--label", f"{LABEL}=1", "--label", f"{RUN_LABEL}={run_id}",
            "--cpus", f"{cpus:g}",
            "--memory", f"{task.memory_mb}m", "--memory-swap", f"{task.memory_mb}m",
            "--pids-limit", str(PIDS_LIMIT),
            "--entrypoint", "sleep",
        ]  # fmt: skip
        if not task.allow_internet:
            argv += ["--network", "none"]
        argv += [image, str(int(lifetime_s))]
        try:
            code, out, err, _, timed_out = await _exec(argv, None, 120, 4096, finish_on_cancel=30)
        except asyncio.CancelledError:  # stopped while starting: what the client made goes
            await _exec(["rm", "-f", "-v", name], None, 60, 4096)
            raise
        if code != 0 or timed_out:
            # A container may exist even when the client gave up: remove it by name.
            await _exec(["rm", "-f", name], None, 60, 4096)
            why = "no answer in 120s" if timed_out else _last_line(err)
            raise RuntimeError(f"docker run for task {task.name} failed: {why}")
        container = out.decode().strip()
        with _LIVE_LOCK:
            _LIVE.add(container)
        stats = {"task": task.name, "container": container[:12], "commands": 0, "command_s": 0.0}
        stats["start_s"] = round(time.monotonic() - started, 4)
        return cls(container, task, stats)

    @property
    def sandbox_id(self) -> str:
        return self._id

    async def send_heartbeat(self, timeout: int = 30) -> None:
        """Nothing to keep alive: the container lives until ``cleanup`` or its lifetime."""

    async def run_command(
        self,
        command: str,
        workdir: str | None = None,
        timeout: int = 60,
        max_output_bytes: int | None = None,
    ):
        from tinker_cookbook.sandbox import SandboxResult

        cap = max_output_bytes or DEFAULT_OUTPUT_BYTES
        argv = ["exec"] + (["-w", workdir] if workdir else [])
        # timeout(1) runs the command in its own process group and kills all of it.
        argv += [self._id, "timeout", "-k", "2", str(int(timeout)), "bash", "-c", command]
        started = time.monotonic()
        code, out, err, truncated, client_timeout = await _exec(argv, None, timeout + 15, cap)
        took = time.monotonic() - started
        self.stats["commands"] += 1
        self.stats["command_s"] = round(self.stats["command_s"] + took, 4)
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        if truncated:
            stderr += f"\n[rlcli: output cut at {cap} bytes]"
        if client_timeout or (code in (TIMEOUT_EXIT, 137) and took >= timeout):
            self.stats["timeouts"] = self.stats.get("timeouts", 0) + 1
            stderr += f"\n[rlcli: command timed out after {int(timeout)}s and was killed]"
            return SandboxResult(stdout=stdout, stderr=stderr.lstrip("\n"), exit_code=TIMEOUT_EXIT)
        return SandboxResult(stdout=stdout, stderr=stderr, exit_code=code)

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60):
        from tinker_cookbook.sandbox import SandboxResult

        cap = max_bytes or DEFAULT_OUTPUT_BYTES
        code, out, err, _, timed_out = await _exec(
            ["exec", self._id, "cat", "--", path], None, timeout, cap
        )
        if timed_out:
            return SandboxResult(stdout="", stderr="read timed out", exit_code=TIMEOUT_EXIT)
        return SandboxResult(
            stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"), exit_code=code
        )

    async def write_file(
        self, path: str, content: str | bytes, executable: bool = False, timeout: int = 60
    ):
        from tinker_cookbook.sandbox import SandboxResult

        data = content.encode() if isinstance(content, str) else content
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1"' + (' && chmod +x "$1"' * executable)
        code, out, err, _, timed_out = await _exec(
            ["exec", "-i", self._id, "sh", "-c", script, "sh", path], data, timeout, 65536
        )
        if timed_out:
            return SandboxResult(stdout="", stderr="write timed out", exit_code=TIMEOUT_EXIT)
        return SandboxResult(
            stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"), exit_code=code
        )

    async def cleanup(self) -> None:
        if self._removed:
            return
        self._removed = True
        await _exec(["rm", "-f", "-v", self._id], None, 60, 4096)
        with _LIVE_LOCK:
            _LIVE.discard(self._id)


class DockerSandboxFactory:
    """The cookbook's ``sandbox_factory(env_dir, timeout)``: finds the task by its
    ``environment/`` folder, builds its image once (per content hash), starts a container.
    ``stats_path``: where each container's timings go when it is cleaned up (JSON lines)."""

    def __init__(self, tasks: list[TaskSpec], run_id: str, stats_path: Path | None = None):
        self.tasks = {str(t.environment.resolve()): t for t in tasks}  # str: config.json
        self.run_id = run_id
        self.stats_path = stats_path
        self._images: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def image_for(self, task: TaskSpec) -> str:
        lock = self._locks.setdefault(task.name, asyncio.Lock())
        async with lock:
            if task.name not in self._images:
                tag, _ = await asyncio.to_thread(ensure_image, task)
                self._images[task.name] = tag
        return self._images[task.name]

    async def __call__(self, env_dir: Path, timeout: int) -> DockerSandbox:
        task = self.tasks.get(str(Path(env_dir).resolve()))
        if task is None:
            raise RuntimeError(f"no task has the environment folder {env_dir}")
        image = await self.image_for(task)
        sandbox = await DockerSandbox.create(task, self.run_id, image, timeout)
        if self.stats_path is not None:
            sandbox.cleanup = _recording(sandbox, self.stats_path)  # type: ignore[method-assign]
        return sandbox


def _recording(sandbox: DockerSandbox, path: Path):
    """``cleanup`` that also appends the container's timings to ``path``."""
    original = sandbox.cleanup

    async def cleanup() -> None:
        first = not sandbox._removed
        started = time.monotonic()
        await original()
        if first:
            sandbox.stats["remove_s"] = round(time.monotonic() - started, 4)
            with contextlib.suppress(OSError), path.open("a") as f:
                f.write(json.dumps({**sandbox.stats, "time": time.time()}) + "\n")

    return cleanup

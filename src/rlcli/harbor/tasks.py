"""Harbor task folders: load, validate, filter; resolve ``--dataset``.

A task folder holds ``instruction.md``, ``task.toml``, ``environment/Dockerfile`` (or a
prebuilt ``[environment] docker_image``), ``tests/test.sh`` and, optionally,
``solution/solve.sh``. Every problem of a folder is found before any container starts and
reported as one line naming the folder and what is wrong.

``--dataset`` is a local folder of task folders (or one task folder), or ``name@version``: a
dataset under the Harbor cache (``~/.cache/harbor/tasks/<name>-<version>``, where the cookbook's
recipe has it downloaded; ``<name@version>`` is read too), downloaded with ``uvx harbor datasets
download NAME@VERSION -o FOLDER`` when missing. Task folders may sit one level down, in the hash
folders Harbor's downloads use.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcli.errors import RlcliError
from rlcli.files.lastline import last_line

DEFAULT_DATASET = "terminal-bench@2.0"
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_MB = 2048
DEFAULT_VERIFIER_TIMEOUT_S = 60
GRADER_TIMEOUT_S = 60  # the reward's grader; a task's [verifier] timeout_sec raises it
MAX_TRAJECTORY_TOKENS = 32 * 1024  # the cookbook's default: past it the episode ends
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNIT_MB = {"": 1 / (1024 * 1024), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def harbor_cache() -> Path:
    """Where Harbor keeps downloaded datasets (``$HARBOR_CACHE_DIR`` overrides it)."""
    env = os.environ.get("HARBOR_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "harbor" / "tasks"


@dataclass(frozen=True)
class TaskSpec:
    """One validated task: what the sandbox and the verifier need from its folder."""

    name: str
    folder: Path
    instruction: str
    config: dict[str, Any] = field(default_factory=dict)
    cpus: float = DEFAULT_CPUS
    memory_mb: int = DEFAULT_MEMORY_MB
    allow_internet: bool = False
    docker_image: str | None = None
    verifier_timeout_s: int = DEFAULT_VERIFIER_TIMEOUT_S

    @property
    def environment(self) -> Path:
        return self.folder / "environment"

    @property
    def tests(self) -> Path:
        return self.folder / "tests"

    @property
    def solution(self) -> Path | None:
        path = self.folder / "solution" / "solve.sh"
        return path if path.is_file() else None


def _memory_mb(value: Any, where: str) -> int:
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value)
    match = _MEMORY.match(str(value))
    if not match:
        raise RlcliError(f"{where}: memory {value!r}: expected megabytes or e.g. '2G', '512M'")
    return max(1, math.ceil(float(match.group(1)) * _UNIT_MB[match.group(2).lower()]))


def load_task(folder: Path) -> TaskSpec:
    """One task folder, validated; ``RlcliError`` naming the folder and the problem."""
    folder = Path(folder)
    where = f"task {folder}"
    if not folder.is_dir():
        raise RlcliError(f"{where}: not a folder")
    instruction_file, toml_file = folder / "instruction.md", folder / "task.toml"
    if not instruction_file.is_file():
        raise RlcliError(f"{where}: no instruction.md")
    instruction = instruction_file.read_text(errors="replace")
    if not instruction.strip():
        raise RlcliError(f"{where}: instruction.md is empty")
    if not toml_file.is_file():
        raise RlcliError(f"{where}: no task.toml")
    try:
        config = tomllib.loads(toml_file.read_text(errors="replace"))
    except tomllib.TOMLDecodeError as e:
        raise RlcliError(f"{where}: task.toml is not valid TOML ({e})") from None
    env = config.get("environment") or {}
    verifier = config.get("verifier") or {}
    if not isinstance(env, dict) or not isinstance(verifier, dict):
        raise RlcliError(f"{where}: task.toml: [environment] and [verifier] must be tables")
    image = env.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise RlcliError(f"{where}: task.toml: docker_image must be an image name")
    if not image and not (folder / "environment" / "Dockerfile").is_file():
        raise RlcliError(
            f"{where}: no environment/Dockerfile (and no [environment] docker_image in task.toml)"
        )
    if not (folder / "tests" / "test.sh").is_file():
        raise RlcliError(f"{where}: no tests/test.sh (the verifier)")
    cpus = env.get("cpus", DEFAULT_CPUS)
    if isinstance(cpus, bool) or not isinstance(cpus, int | float) or cpus <= 0:
        raise RlcliError(f"{where}: task.toml: cpus {cpus!r}: expected a positive number")
    memory = env.get("memory_mb", env.get("memory", DEFAULT_MEMORY_MB))
    memory_mb = _memory_mb(memory, f"{where}: task.toml")
    if memory_mb < 6:
        raise RlcliError(f"{where}: task.toml: memory {memory!r}: Docker needs at least 6 MB")
    internet = env.get("allow_internet", False)
    if not isinstance(internet, bool):
        raise RlcliError(f"{where}: task.toml: allow_internet must be true or false")
    timeout = verifier.get("timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise RlcliError(f"{where}: task.toml: [verifier] timeout_sec must be a positive number")
    return TaskSpec(
        name=folder.name,
        folder=folder.resolve(),
        instruction=instruction,
        config=config,
        cpus=float(cpus),
        memory_mb=memory_mb,
        allow_internet=internet,
        docker_image=image.strip() if image else None,
        verifier_timeout_s=math.ceil(timeout),
    )


def is_task_folder(folder: Path) -> bool:
    return (folder / "task.toml").is_file() or (folder / "instruction.md").is_file()


def load_tasks(
    root: Path, task_filter: str | None = None, max_tasks: int | None = None
) -> list[TaskSpec]:
    """The task folders under ``root`` (or ``root`` itself when it is one), by name, filtered
    by name or glob (``task_filter``, comma-separated alternatives allowed), at most
    ``max_tasks``; every kept folder validated. Hidden folders are skipped."""
    root = Path(root)
    if is_task_folder(root):
        folders = [root]
    else:
        folders = []
        for child in _subfolders(root):
            # Harbor's downloads may nest each task in a hash folder: <hash>/<task_name>/.
            folders += [child] if is_task_folder(child) else _subfolders(child)
        folders.sort(key=lambda p: (p.name, str(p)))
    if not folders:
        raise RlcliError(f"--dataset {root}: no task folders in it")
    if task_filter:
        patterns = [p.strip() for p in task_filter.split(",") if p.strip()]
        folders = [f for f in folders if any(fnmatch.fnmatchcase(f.name, p) for p in patterns)]
        if not folders:
            raise RlcliError(f"--task-filter {task_filter}: no task of {root} matches it")
    if max_tasks is not None:
        folders = folders[:max_tasks]
    return [load_task(f) for f in folders]


def _subfolders(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))]


def is_dataset_name(dataset: str) -> bool:
    """``name@version`` (and not an existing path)."""
    return "@" in dataset and "/" not in dataset and not Path(dataset).expanduser().exists()


def dataset_tasks(
    dataset: str, task_filter: str | None, max_tasks: int | None, download: bool = True
) -> tuple[Path, str, list[TaskSpec]]:
    """``--dataset`` (a folder, or name@version in the Harbor cache) -> (folder, where it came
    from, its tasks after ``--task-filter`` and ``--max-tasks``): train harbor and eval rl."""
    folder, source = resolve_dataset(dataset, download=download)
    return folder, source, load_tasks(folder, task_filter, max_tasks)


def resolve_dataset(dataset: str, download: bool = True) -> tuple[Path, str]:
    """(folder of task folders, where it came from). A ``name@version`` missing from the
    Harbor cache is downloaded with ``uvx harbor datasets download`` when ``download``."""
    if not is_dataset_name(dataset):
        path = Path(dataset).expanduser()
        if not path.exists():
            raise RlcliError(
                f"--dataset {dataset}: no such folder (a folder of Harbor task folders, or "
                "name@version such as terminal-bench@2.0)"
            )
        if not path.is_dir():
            raise RlcliError(f"--dataset {dataset}: not a folder of Harbor task folders")
        return path.resolve(), "local folder"
    # The cookbook's recipe downloads terminal-bench@2.0 into <cache>/terminal-bench-2.0.
    cached = harbor_cache() / dataset.replace("@", "-")
    for folder in (cached, harbor_cache() / dataset):
        if folder.is_dir() and any(folder.iterdir()):
            return folder, f"Harbor cache ({folder})"
    hint = (
        f"or pass a local folder of task folders, e.g. --dataset examples/harbor-tasks "
        f"(or put the dataset in {cached})"
    )
    if not download:
        raise RlcliError(f"--dataset {dataset}: not in the Harbor cache ({cached}); {hint}")
    _download(dataset, cached, hint)
    if not cached.is_dir() or not any(cached.iterdir()):
        raise RlcliError(f"--dataset {dataset}: the download left nothing in {cached}; {hint}")
    return cached, f"Harbor cache ({cached}, downloaded)"


def _download(dataset: str, target: Path, hint: str) -> None:
    """``uvx harbor datasets download NAME@VERSION`` into the Harbor cache; one clear line on
    any failure (no ``uvx``, offline, unknown dataset)."""
    uvx = shutil.which("uvx")
    if uvx is None:
        raise RlcliError(
            f"--dataset {dataset}: not in the Harbor cache and `uvx` is not installed to "
            f"download it (uvx harbor datasets download {dataset}); {hint}"
        )
    command = [uvx, "harbor", "datasets", "download", dataset, "-o", str(target)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RlcliError(f"--dataset {dataset}: download failed ({e}); {hint}") from None
    if done.returncode != 0:
        last = last_line(done.stderr or done.stdout or "") or f"exit code {done.returncode}"
        raise RlcliError(
            f"--dataset {dataset}: `uvx harbor datasets download` failed ({last}); {hint}"
        )

"""The environment registry: one place that says what an RL environment's problems are and how
an answer is graded, for both ``rlcli train rl --dataset`` and ``rlcli eval rl --env``.

An environment hands out problems (small JSON-able rows) per split and turns a row into the
cookbook ``ProblemEnv`` that prompts and grades it; training wraps those envs in the cookbook's
``ProblemGroupBuilder`` (``recipes/env_builder.py``) and evaluation calls
``initial_observation()`` / ``step(tokens)`` on the very same objects, so a reward means the same
thing in both. Specs: ``gsm8k``, ``arithmetic``, ``niah`` (``niah:words=500,depth=0.5``), or a
path to a JSONL file of ``{"question", "answer"}``; and, for ``eval rl`` only (``harbor=True``),
Harbor tasks (a task folder, a folder of them, or ``name@version``): ``envs/harbor.py``, a
``multi_turn`` environment scored by whole episodes in containers. ``train rl --dataset`` refuses
Harbor tasks with one line pointing at ``rlcli train harbor``, the command that trains on them
(with the same episodes and verifier). Nothing here imports torch or tinker at import time
(``rlcli --help`` stays fast); the cookbook comes in with ``make_env``.
"""

from __future__ import annotations

from pathlib import Path

from rlcli.envs.base import Environment, Problems
from rlcli.errors import RlcliError
from rlcli.harbor.tasks import is_dataset_name, is_task_folder

NAMES = ("gsm8k", "arithmetic", "niah")
USAGE = "gsm8k, arithmetic, niah[:words=N,depth=D], or a .jsonl file of {question, answer}"
HARBOR_USAGE = "; or Harbor tasks: a task folder, a folder of them, or name@version"

__all__ = ["NAMES", "USAGE", "Environment", "Problems", "get"]


def get(
    spec: str,
    *,
    flag: str = "--env",
    gsm8k_dir: str | None = None,
    harbor: bool = False,
    task_filter: str | None = None,
    reward: dict | None = None,
) -> Environment:
    """The environment ``spec`` names; one line naming ``flag`` if it names none.

    ``gsm8k_dir``: GSM8K's folder (``--gsm8k-dir``; else ``$RLCLI_GSM8K_DIR``, else the hub).
    ``harbor``: Harbor tasks are an environment here (``eval rl``), kept to ``task_filter``.
    ``reward``: a user's reward function for a JSONL file (``JsonlFile``); refused elsewhere.
    """
    if reward and spec.partition(":")[0] in NAMES:
        raise RlcliError(
            f'--reward: needs a JSONL --dataset of {{"question", ...}} rows; {spec} grades '
            "its own answers"
        )
    name, _, params = spec.partition(":")
    if name in NAMES:
        settings = _params(params, spec, flag)
        if name == "gsm8k":
            from rlcli.envs.gsm8k import Gsm8k  # lazy: loaded when its spec is asked for

            _no_params(settings, spec, flag)
            return Gsm8k(gsm8k_dir)
        if name == "arithmetic":
            from rlcli.envs.arithmetic import Arithmetic  # lazy: loaded when its spec is asked for

            _no_params(settings, spec, flag)
            return Arithmetic()
        from rlcli.envs.niah import Niah  # lazy: loaded when its spec is asked for

        return Niah.from_params(settings, spec, flag)
    usage = USAGE + (HARBOR_USAGE if harbor else "")
    path = Path(spec).expanduser()

    if (path.is_dir() and _harbor(path)) or is_dataset_name(spec):
        if harbor:
            from rlcli.envs.harbor import HarborTasks  # lazy: loaded when its spec is asked for

            return HarborTasks(spec, flag, task_filter)
        raise RlcliError(
            f"{flag} {spec}: Harbor tasks (multi-turn episodes in containers) are trained on "
            f"with `rlcli train harbor --dataset {spec}` (and scored with `rlcli eval rl --env "
            f"{spec}`)"
        )
    if path.is_dir():
        raise RlcliError(f"{flag} {spec}: a folder, not an environment; use {usage}")
    if path.is_file():
        from rlcli.envs.jsonl import JsonlFile  # lazy: loaded when its spec is asked for

        return JsonlFile(path, flag, reward)
    if path.suffix == ".jsonl" or "/" in spec:
        raise RlcliError(f"{flag} {spec}: no such file")
    raise RlcliError(f"{flag} {spec}: unknown environment; use {usage}")


def _harbor(folder: Path) -> bool:
    """A Harbor task folder, or a folder of them (what ``train harbor --dataset`` takes)."""
    return is_task_folder(folder) or any(
        p.is_dir() and is_task_folder(p) for p in folder.iterdir() if not p.name.startswith(".")
    )


def _params(text: str, spec: str, flag: str) -> dict[str, str]:
    out = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise RlcliError(f"{flag} {spec}: expected name:key=value,... (got {item!r})")
        out[key.strip()] = value.strip()
    return out


def _no_params(settings: dict, spec: str, flag: str) -> None:
    if settings:
        raise RlcliError(f"{flag} {spec}: this environment takes no settings")

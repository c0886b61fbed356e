"""Checkpoints on disk, and the ``tinker://`` paths that name them.

Layout under the checkpoints dir (one folder per training run, i.e. per training client)::

    <run_id>/run.json                      base model, LoRA config, owner session, times
    <run_id>/weights/<name>/               save_state: adapter + optimizer.pt
    <run_id>/sampler_weights/<name>/       save_weights_for_sampler: adapter only

Each checkpoint folder is a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``)
that ``peft.PeftModel.from_pretrained(base, folder)`` loads, plus ``checkpoint.json`` (its
metadata). Writes go to a temporary sibling and are renamed into place, so a crash never
leaves half a checkpoint behind.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CheckpointError(ValueError):
    """A bad checkpoint name or path; the message says which and why."""


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    kind: str  # "weights" | "sampler_weights"
    name: str

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    def folder(self, root: Path) -> Path:
        return root / self.run_id / self.kind / self.name


def check_name(name: str, field: str = "path") -> str:
    """A checkpoint or run name that stays inside its folder: no '/', no '..', no dotfiles."""
    if not _NAME.match(name or "") or ".." in name:
        raise CheckpointError(
            f"{field}: {name!r} is not a valid checkpoint name "
            "(letters, digits, '.', '_', '-'; no '/' or '..')"
        )
    return name


def parse_tinker_path(path: str) -> CheckpointRef:
    """``tinker://<run_id>/<weights|sampler_weights>/<name>`` -> CheckpointRef."""
    if not path.startswith("tinker://"):
        raise CheckpointError(f"path: {path!r} is not a tinker:// path")
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise CheckpointError(
            f"path: {path!r} is not of the form tinker://<run_id>/weights/<name> "
            "or tinker://<run_id>/sampler_weights/<name>"
        )
    return CheckpointRef(check_name(parts[0], "run_id"), parts[1], check_name(parts[2]))


def write_run(root: Path, run_id: str, record: dict[str, Any]) -> None:
    folder = Path(root) / check_name(run_id, "run_id")
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / "run.json", json.dumps(record, indent=2) + "\n")


def read_run(root: Path, run_id: str) -> dict[str, Any] | None:
    try:
        return json.loads((Path(root) / check_name(run_id, "run_id") / "run.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def list_runs(root: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(Path(root).glob("*/run.json")):
        try:
            runs.append(json.loads(path.read_text()))
        except json.JSONDecodeError:
            continue
    return sorted(runs, key=lambda r: r.get("created", 0))


def list_checkpoints(root: Path, run_id: str) -> list[dict[str, Any]]:
    out = []
    for kind in KINDS:
        for meta in sorted((Path(root) / run_id / kind).glob("*/checkpoint.json")):
            try:
                out.append(json.loads(meta.read_text()))
            except json.JSONDecodeError:
                continue
    return sorted(out, key=lambda c: c.get("created", 0))


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def write_adapter(
    directory: str | Path,
    state: dict,
    config,
    base_model: str,
    *,
    optimizer: dict | None = None,
    meta: dict[str, Any],
) -> None:
    """Write a PEFT adapter folder (and optimizer state) atomically at ``directory``."""
    import copy

    import torch
    from safetensors.torch import save_file

    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        config = copy.deepcopy(config)
        config.base_model_name_or_path = base_model
        config.save_pretrained(str(tmp))
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "adapter_model.safetensors")
        if optimizer is not None:
            torch.save(optimizer, tmp / "optimizer.pt")
        meta = {**meta, "created": time.time(), "size_bytes": folder_size(tmp)}
        (tmp / "checkpoint.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_adapter(directory: str | Path, optimizer: bool):
    """(LoraConfig, state dict, optimizer state or None) from a checkpoint folder."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import load_file

    folder = Path(directory)
    config = LoraConfig.from_pretrained(str(folder))
    state = load_file(folder / "adapter_model.safetensors")
    optim_state = None
    if optimizer and (folder / "optimizer.pt").exists():
        optim_state = torch.load(folder / "optimizer.pt", weights_only=True)
    return config, state, optim_state


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)

"""``rlcli export``: a checkpoint of a Tinker server to files others load, then optionally to
the Hugging Face Hub.

What is written: a PEFT adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``, what ``peft.PeftModel.from_pretrained`` loads); with ``merge`` a
transformers model folder; with ``with_optimizer`` the training state with its ``optimizer.pt``
and ``run.json``, which is what ``rlcli restore`` (``restore.py``) needs to continue the run on
another server; with ``gguf`` one ``.gguf`` file for llama.cpp / Ollama. This module decides
what comes from where; each step is its own module: the checkpoint's files fetched from the
server or this machine (``checkpoint_fetch.py``), the adapter merged (``merge.py``), the GGUF
written (``gguf_export.py``), the output checked and put in place whole
(``export_output.py``), the upload (``hub_push.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.checkpoint_format import ARCHIVE_FILES, STATE_FILES
from rlcli.client import endpoint, hub_push
from rlcli.client.checkpoint_fetch import Say, check_source, fetch, local_version
from rlcli.client.export_output import MANIFEST, check_gguf_output, check_output, put_in_place
from rlcli.client.merge import merge
from rlcli.errors import RlcliError
from rlcli.flags import BASE_URL_HELP, option
from rlcli.home import checkpoints_dir


def export(
    origin: str | Path,
    path: str,
    out: Path,
    *,
    merge_model: bool = False,
    with_optimizer: bool = False,
    base_model: str | None = None,
    force: bool = False,
    say: Say = lambda _: None,
) -> dict[str, Any]:
    """Write the checkpoint at ``path`` to ``out`` (see the module docstring); a summary.
    ``origin``: the server's URL, or the checkpoint's version folder on this machine."""
    check_source(path, with_optimizer)
    if merge_model and with_optimizer:
        raise RlcliError("--merge and --with-optimizer: a merged model has no optimizer state")
    out = check_output(out, force)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.download-", dir=out.parent))
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        wanted = ARCHIVE_FILES + (STATE_FILES if with_optimizer else ())
        adapter_dir = work / "adapter" if merge_model else staged
        adapter_dir.mkdir(exist_ok=True)
        fetch(origin, path, adapter_dir, wanted, work, say)
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        trained_on = config.get("base_model_name_or_path")
        if merge_model:
            merge(adapter_dir, base_model or trained_on, staged, say)
        manifest = {
            "source": path,
            "server": str(origin),
            "base_model": trained_on,
            "lora_rank": config.get("r"),
            "merged": merge_model,
            "with_optimizer": with_optimizer,
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        owned = sorted(p.name for p in staged.iterdir())
        (staged / MANIFEST).write_text(json.dumps({**manifest, "files": owned}, indent=2) + "\n")
        files = [
            {"file": p.name, "bytes": p.stat().st_size}
            for p in sorted(staged.iterdir())
            if p.is_file()
        ]
        put_in_place(staged, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(staged, ignore_errors=True)  # gone already when it was renamed
    return {"output": str(out), **manifest, "files": files}


def check_flags(gguf: bool, with_optimizer: bool) -> None:
    """Flags that cannot go together, refused before a run's checkpoints are looked up."""
    if gguf and with_optimizer:
        raise RlcliError("--gguf and --with-optimizer: a GGUF file has no optimizer state")


@dataclass(kw_only=True)
class ExportOptions:
    """``rlcli export``'s flags (``rlcli.flags``); the Python API's ``export`` takes them as
    keywords."""

    run: str | None = option(
        None,
        "A run, as `rlcli runs` takes it (its id, a unique prefix, or its folder): its last "
        "checkpoint.",
        argument=True,
    )
    checkpoint: str | None = option(
        None, "tinker://RUN/(weights|sampler_weights)/NAME.", flags=("-c",)
    )
    output: str = option(
        help="Folder to write (new or empty); with --gguf, a .gguf file.", flags=("-o",)
    )
    merge: bool = option(
        False,
        "Merge the adapter into the base model: a transformers model folder "
        "(AutoModelForCausalLM.from_pretrained loads it; so does vLLM).",
    )
    with_optimizer: bool = option(
        False,
        "A training state (weights/...) with its optimizer.pt and run.json, so `rlcli restore` "
        "can continue the run on another server.",
    )
    gguf: bool = option(
        False,
        "One .gguf file of the merged model (base + LoRA) for llama.cpp, Ollama, LM Studio: -o "
        "names the file. Llama (SmolLM2) and Qwen2/Qwen3 models.",
    )
    gguf_type: str = option(
        "f16",
        "With --gguf: the weights' type (q4_0: 4-bit, by the gguf package's quantizer).",
        choices=("f16", "bf16", "q8_0", "q4_0"),
    )
    base_model: str | None = option(
        None, "With --merge/--gguf: where to load the base model from (default: the checkpoint's)."
    )
    force: bool = option(
        False, "Replace an earlier export in the output folder (refused for any other folder)."
    )
    push_to_hub: str | None = option(
        None,
        "Then upload what was written to this Hugging Face model repo (created if missing; "
        "needs a token: hf auth login or HF_TOKEN).",
    )
    hub_private: bool = option(False, "With --push-to-hub: create the repo private.")
    checkpoints_dir: str | None = option(
        None,
        "Read the checkpoint from this folder (a server's --checkpoints-dir) instead of asking a "
        "server; default: $RLCLI_HOME/checkpoints when it holds the checkpoint.",
    )
    base_url: str | None = option(
        None, BASE_URL_HELP + " Given, the checkpoint is downloaded from it, not read here."
    )
    json: bool = option(False, "Print what was written as JSON.", saved=False)


def export_checkpoint(
    path: str, out: Path, options: ExportOptions, say: Say = lambda _: None
) -> dict[str, Any]:
    """``rlcli export`` once its source is a ``tinker://`` path (the CLI's and the Python
    API's): the path checked before any server is asked, then the server found and the folder
    (or, with ``gguf``, the file) written. The callers ``check_flags`` first."""
    o = options
    if o.gguf_type != "f16" and not o.gguf:
        raise RlcliError("--gguf-type: only with --gguf")
    if o.hub_private and not o.push_to_hub:
        raise RlcliError("--hub-private: only with --push-to-hub REPO")
    check_flags(o.gguf, o.with_optimizer)
    check_source(path, o.with_optimizer)
    if o.push_to_hub:  # everything that can refuse the push, before anything is written
        hub_push.check(o.push_to_hub)
    origin = _origin(path, o, say)
    if o.gguf:
        result = export_gguf(
            origin, path, out, gguf_type=o.gguf_type, base_model=o.base_model, force=o.force,
            say=say,
        )  # fmt: skip
    else:
        result = export(
            origin, path, out, merge_model=o.merge, with_optimizer=o.with_optimizer,
            base_model=o.base_model, force=o.force, say=say,
        )  # fmt: skip
    if o.push_to_hub:
        result["hub"] = hub_push.push(out, o.push_to_hub, private=o.hub_private, say=say)
    return result


def _origin(path: str, o: ExportOptions, say: Say) -> str | Path:
    """Where the checkpoint's files come from: this machine's checkpoints folder when they are
    there (``--checkpoints-dir``, else ``$RLCLI_HOME/checkpoints``) and no ``--base-url`` names
    a server, so a finished run exports with no server running; else the server, probed."""
    if not o.base_url:
        root = Path(o.checkpoints_dir).expanduser() if o.checkpoints_dir else checkpoints_dir()
        version = local_version(path, root)
        if version is not None:
            return version
        if o.checkpoints_dir:
            raise RlcliError(f"--checkpoints-dir {o.checkpoints_dir}: no checkpoint {path} there")
    url, where = endpoint.resolve_base_url(o.base_url)
    endpoint.check_server(url, source=where)
    say(endpoint.describe(url, where))
    return url


def export_gguf(
    origin: str | Path,
    path: str,
    out: Path,
    *,
    gguf_type: str = "f16",
    base_model: str | None = None,
    force: bool = False,
    say: Say = lambda _: None,
) -> dict[str, Any]:
    """The checkpoint at ``path`` merged into its base model, as one GGUF file ``out``.

    Written beside ``out`` under a hidden name and renamed at the end; ``--force`` replaces
    only a GGUF file (its magic bytes), nothing else."""
    from rlcli.client.gguf_export import TYPES, write_gguf  # lazy: imports numpy

    check_source(path, False)
    if gguf_type not in TYPES:
        raise RlcliError(f"--gguf-type {gguf_type}: not one of {', '.join(TYPES)}")
    out = check_gguf_output(out, force)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        adapter = work / "adapter"
        adapter.mkdir()
        fetch(origin, path, adapter, ARCHIVE_FILES, work, say)
        config = json.loads((adapter / "adapter_config.json").read_text())
        trained_on = config.get("base_model_name_or_path")
        merge(adapter, base_model or trained_on, work / "merged", say, as_saved=False)
        say(f"writing {gguf_type} GGUF ...")
        staged = work / out.name
        written = write_gguf(work / "merged", staged, gguf_type, name=path.rsplit("/", 1)[-1])
        if out.exists():
            check_gguf_output(out, force)  # again: it may have appeared meanwhile
        os.replace(staged, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "output": str(out),
        "source": path,
        "server": str(origin),
        "base_model": trained_on,
        "lora_rank": config.get("r"),
        **written,
        "bytes": out.stat().st_size,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

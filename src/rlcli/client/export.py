"""Export a checkpoint from a Tinker server to a folder others load, and put a training state
back on a server (``rlcli export`` / ``rlcli restore``).

``export`` downloads the checkpoint's archive through the route ``tinker checkpoint download``
uses (``GET .../checkpoints/KIND/NAME/archive`` -> a ``.tar`` link; a 302 or a JSON answer) and
unpacks it: a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``,
what ``peft.PeftModel.from_pretrained`` loads). ``merge`` applies the adapter to the base model
(``merge_and_unload``) and saves a transformers model folder (and so one vLLM serves).
``with_optimizer`` asks our server for ``optimizer.pt`` and the run's ``run.json`` too (query
``include_optimizer=true``, rlcli's opt-in; the tinker CLI's archive is unchanged), which is what
``restore`` needs to continue the run on another server. ``export_gguf`` merges in float32 and
writes one ``.gguf`` file for llama.cpp / Ollama (``gguf_export.py``).

Nothing is half-written: everything is built in a hidden folder beside ``-o DIR`` and renamed
into place at the end; on any failure the hidden folders go and DIR is as it was.
Nothing else is lost: ``--force`` replaces a non-empty DIR only when it is a previous export
(its manifest lists every file in it), checked again just before the rename; any other folder
(``-o .``, a project folder) is refused, naming it (``check_replaceable``).
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rlcli import checkpoint_format
from rlcli.checkpoint_format import (
    ARCHIVE_FILES,
    RESTORE_FILES,
    STATE_FILES,
    TinkerPathError,
    parse_tinker_path,
)
from rlcli.client import endpoint, hub_push
from rlcli.client.sample_chat import split_tinker_path
from rlcli.errors import RlcliError
from rlcli.flags import BASE_URL_HELP, option
from rlcli.home import checkpoints_dir

MANIFEST = "rlcli_export.json"  # where it came from: restore reads the tinker:// path here

Say = Callable[[str], None]


# ---- which checkpoint ----------------------------------------------------------------------


def check_source(path: str, with_optimizer: bool) -> tuple[str, str, str]:
    run_id, kind, name = split_tinker_path(path)
    if with_optimizer and kind != "weights":
        raise RlcliError(
            f"--with-optimizer: {path} is sampler weights (no optimizer state); pass the "
            f"training state, e.g. tinker://{run_id}/weights/{name}"
        )
    return run_id, kind, name


# ---- download ------------------------------------------------------------------------------


def archive_url(url: str, path: str, with_optimizer: bool) -> str:
    run_id, kind, name = check_source(path, with_optimizer)
    route = f"/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/archive"
    params = {"include_optimizer": "true"} if with_optimizer else None
    try:
        response = httpx.get(
            f"{url}{route}", params=params, headers=endpoint.headers(), timeout=300
        )
    except httpx.HTTPError as e:
        raise RlcliError(f"no answer from {url}{route} ({type(e).__name__})") from None
    if response.status_code in (301, 302, 303, 307) and response.headers.get("location"):
        return response.headers["location"]
    if response.status_code == 404:
        raise RlcliError(f"{path}: the server at {url} has no such checkpoint")
    if response.status_code >= 400:
        raise RlcliError(f"{path}: {url} answered HTTP {response.status_code}: "
                         f"{endpoint._detail(response)}")  # fmt: skip
    try:
        link = response.json()["url"]
    except (ValueError, KeyError, TypeError):
        raise RlcliError(f"{url}{route} answered no archive link") from None
    if with_optimizer and "/rlcli/archives/" not in link:
        raise RlcliError(
            f"--with-optimizer: the server at {url} is not rlcli's; its archives leave the "
            "optimizer state out"
        )
    return link


def download(link: str, dest: Path, say: Say) -> int:
    """Fetch the archive to ``dest``; its size in bytes."""
    size = 0
    started = time.monotonic()
    try:
        with httpx.stream("GET", link, timeout=300, follow_redirects=True) as response:
            if response.status_code >= 400:
                response.read()
                raise RlcliError(
                    f"the archive download answered HTTP {response.status_code}: "
                    f"{endpoint._detail(response)}"
                )
            with open(dest, "wb") as out:
                for chunk in response.iter_bytes(1 << 20):
                    out.write(chunk)
                    size += len(chunk)
    except httpx.HTTPError as e:
        raise RlcliError(f"the archive download failed ({type(e).__name__})") from None
    say(f"downloaded {human(size)} in {time.monotonic() - started:.1f}s")
    return size


# ---- or read from this machine ------------------------------------------------------------


def local_version(path: str, root: Path) -> Path | None:
    """The version folder of checkpoint ``path`` under a checkpoints folder on this machine
    (what ``serve start`` writes, ``$RLCLI_HOME/checkpoints`` by default), or None. Run ids are
    UUIDs, so a folder of that name holds that run's checkpoints and no other server's."""
    try:
        ref = parse_tinker_path(path)
    except TinkerPathError:
        return None
    return checkpoint_format.resolve(ref.folder(root))


def copy_local(version: Path, folder: Path, wanted: tuple[str, ...]) -> None:
    """``wanted`` from a version folder (and ``run.json`` from its run's folder) into
    ``folder``: the files the server's archive of that checkpoint would hold."""
    run_json = version.parent.parent / "run.json"
    for name in wanted:
        source = run_json if name == "run.json" else version / name
        if source.is_file():
            shutil.copyfile(source, folder / name)
    missing = [n for n in wanted if n != "checkpoint.json" and not (folder / n).is_file()]
    if missing:
        raise RlcliError(f"{version}: the checkpoint lacks {', '.join(missing)}")


def fetch(origin: str | Path, path: str, folder: Path, wanted, work: Path, say: Say) -> None:
    """The checkpoint's ``wanted`` files into ``folder``: copied from its version folder when
    ``origin`` is one (a ``Path``), else downloaded from the server at ``origin`` (a URL)."""
    if isinstance(origin, Path):
        say(f"reading {path} from {origin} (no server needed)")
        copy_local(origin, folder, wanted)
        return
    link = archive_url(origin, path, "optimizer.pt" in wanted)
    say(f"downloading {path} ...")
    download(link, work / "checkpoint.tar", say)
    unpack(work / "checkpoint.tar", folder, wanted)


def unpack(tar_path: Path, folder: Path, wanted: tuple[str, ...]) -> None:
    """The archive's ``wanted`` files into ``folder``: plain files with plain names only."""
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            for member in tar:
                if member.name not in wanted or not member.isfile():
                    continue
                source = tar.extractfile(member)
                with source, open(folder / member.name, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
    except (tarfile.TarError, EOFError) as e:
        raise RlcliError(f"the downloaded archive is not a whole tar file ({e})") from None
    missing = [n for n in wanted if n != "checkpoint.json" and not (folder / n).is_file()]
    if missing:
        raise RlcliError(f"the server's archive lacks {', '.join(missing)}")


# ---- merge ---------------------------------------------------------------------------------


def merge(adapter: Path, base_model: str, out: Path, say: Say, as_saved: bool = True) -> None:
    """Base model + adapter, merged, saved with the tokenizer as a transformers folder.

    Merged in float32 (exact sums), then cast back to the base model's saved dtype, read from
    its config before loading (loading in float32 makes the loaded config say float32), unless
    ``as_saved`` is False (the GGUF export rounds once, to its own type)."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    say(f"loading the base model {base_model} ...")
    try:
        config = AutoConfig.from_pretrained(base_model)
        saved_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved_dtype, str):
            saved_dtype = getattr(torch, saved_dtype, None)
        model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(base_model)
    except (OSError, ValueError) as e:
        raise RlcliError(
            f"cannot load the base model {base_model} here ({type(e).__name__}); pass "
            "--base-model with a local copy or its hub id"
        ) from None
    say("merging the adapter ...")
    if _adapts_output_layer(adapter):
        _untie_output_layer(model)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    if as_saved and isinstance(saved_dtype, torch.dtype) and saved_dtype != torch.float32:
        merged = merged.to(saved_dtype)
        merged.config.dtype = saved_dtype
    merged.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _adapts_output_layer(adapter: Path) -> bool:
    """Whether the adapter's LoRA targets the output layer (``lm_head``: the cookbook's
    ``train_unembed`` default), from its ``adapter_config.json``."""
    try:
        targets = json.loads((adapter / "adapter_config.json").read_text()).get("target_modules")
    except (OSError, ValueError):
        return False
    if isinstance(targets, str):  # a regular expression over module names
        return "lm_head" in targets
    return "lm_head" in (targets or [])


def _untie_output_layer(model) -> bool:
    """Give a tied output layer its own weight (and the config ``tie_word_embeddings=False``).

    Why: with tied embeddings (SmolLM2, Qwen's small models) the output layer and the input
    embedding are one matrix, and peft merges the output layer's LoRA into it: the merged
    model would then embed tokens with the output layer's update too, which the trained model
    never did. Untied, the merge changes the output layer alone. Returns whether it untied."""
    import torch

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    text_config = getattr(model.config, "get_text_config", lambda: None)()
    if text_config is not None:
        text_config.tie_word_embeddings = False
    return True


# ---- the whole export ----------------------------------------------------------------------


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


@dataclass(kw_only=True)
class RestoreOptions:
    """``rlcli restore``'s flags."""

    folder: str = option(help="A folder `rlcli export --with-optimizer` wrote.", argument=True)
    overwrite: bool = option(False, "Replace a checkpoint of that path already on the server.")
    force: bool = option(
        False, "Accept a server whose base model has another name (same weights, another path)."
    )
    base_url: str | None = option(None, BASE_URL_HELP)
    json: bool = option(False, "Print the result as JSON.", saved=False)


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


def check_gguf_output(out: Path, force: bool) -> Path:
    out = Path(out).expanduser().absolute()
    if out.suffix != ".gguf":
        raise RlcliError(f"-o {out}: with --gguf, name the file to write (ending in .gguf)")
    if out.is_dir():
        raise RlcliError(f"-o {out}: is a folder; with --gguf, -o names a .gguf file")
    if out.exists():
        if not force:
            raise RlcliError(f"-o {out}: exists (pass --force to replace an earlier export)")
        with open(out, "rb") as f:
            if f.read(4) != b"GGUF":
                raise RlcliError(f"-o {out}: not a GGUF file; --force replaces only a GGUF file")
    return _writable_parent(out)


def check_output(out: Path, force: bool) -> Path:
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise RlcliError(f"-o {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise RlcliError(f"-o {out}: not empty (pass --force to replace an earlier export)")
        check_replaceable(out)
    return _writable_parent(out)


def _writable_parent(out: Path) -> Path:
    """``out``, once its parent folder exists and can take a new entry (else one line)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RlcliError(f"-o {out}: cannot create its parent folder ({e.strerror})") from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise RlcliError(f"-o {out}: {out.parent} is not writable")
    return out


def check_replaceable(out: Path) -> None:
    """``--force`` replaces only what export owns: a folder whose manifest lists every entry in
    it. Anything else (a project folder, ``-o .``, an export someone added files to) is refused
    with one line naming the folder; nothing in it is touched."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        owned = set(manifest["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        raise RlcliError(
            f"-o {out}: not empty and not an earlier export (no {MANIFEST} listing its files); "
            "--force replaces only a folder rlcli export wrote: choose a new or empty folder"
        ) from None
    foreign = sorted(p.name for p in out.iterdir() if p.name not in owned)
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise RlcliError(
            f"-o {out}: holds files rlcli export did not write ({shown}); --force replaces only "
            "an export's own files: move them or choose another folder"
        )


def put_in_place(staged: Path, out: Path) -> None:
    """Rename the finished folder to ``out``; an old ``out`` (an earlier export, checked again
    here) is moved aside first and removed only once the new one is in place."""
    umask = os.umask(0)
    os.umask(umask)
    staged.chmod(0o777 & ~umask)  # mkdtemp made it private; DIR gets the usual mode
    for path in staged.rglob("*"):  # and so do its files (safetensors writes 0600 ones)
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)
        elif path.is_dir():
            path.chmod(0o777 & ~umask)
    old = None
    if out.is_dir() and any(out.iterdir()):
        check_replaceable(out)  # again: files may have arrived during the download
        old = out.parent / f".{out.name}.old-{time.time_ns()}"
        out.rename(old)
    try:
        staged.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- restore -------------------------------------------------------------------------------


def restore(
    url: str, folder: Path, *, overwrite: bool = False, force: bool = False, say: Say
) -> dict[str, Any]:
    """Put a training state exported with ``--with-optimizer`` on the server at ``url`` under
    its original ``tinker://`` path (so a run's ``checkpoints.jsonl`` still names it)."""
    folder = Path(folder).expanduser()
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        raise RlcliError(
            f"{folder}: no {MANIFEST} here (not a folder rlcli export wrote)"
        ) from None
    if not manifest.get("with_optimizer"):
        raise RlcliError(
            f"{folder}: exported without --with-optimizer; export the training state with "
            "--with-optimizer to continue training elsewhere"
        )
    missing = [n for n in RESTORE_FILES if not (folder / n).is_file()]
    if missing:
        raise RlcliError(f"{folder}: missing {', '.join(missing)}")
    path = manifest["source"]
    run_id, kind, name = split_tinker_path(path, "source")
    fd, tar_path = tempfile.mkstemp(suffix=".tar")
    try:
        with open(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
            for n in RESTORE_FILES:
                tar.add(folder / n, arcname=n)
        size = Path(tar_path).stat().st_size
        say(f"uploading {human(size)} to {url} as {path} ...")
        params = {"overwrite": str(overwrite).lower(), "force": str(force).lower()}
        route = f"/api/v1/rlcli/restore/{run_id}/{kind}/{name}"
        try:
            with open(tar_path, "rb") as body:
                response = httpx.put(
                    f"{url}{route}",
                    content=body,
                    params=params,
                    headers={**endpoint.headers(), "Content-Type": "application/x-tar"},
                    timeout=600,
                )
        except httpx.HTTPError as e:
            raise RlcliError(f"no answer from {url}{route} ({type(e).__name__})") from None
    finally:
        Path(tar_path).unlink(missing_ok=True)
    if response.status_code in (404, 405):
        raise RlcliError(f"the server at {url} takes no restores (only rlcli's own server does)")
    if response.status_code >= 400:
        raise RlcliError(f"{url} refused the state (HTTP {response.status_code}): "
                         f"{endpoint._detail(response)}")  # fmt: skip
    return {"tinker_path": path, "server": url, "base_model": manifest.get("base_model"),
            "bytes": response.json().get("size_bytes")}  # fmt: skip


def human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"

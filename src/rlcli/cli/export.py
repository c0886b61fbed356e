"""``rlcli export`` (a checkpoint as a PEFT adapter folder or a merged transformers model) and
``rlcli restore`` (an exported training state onto another server).
Thin over ``rlcli.client.export``.
"""

from __future__ import annotations

from pathlib import Path

import typer

from rlcli.cli._output import JSON, emit, info
from rlcli.errors import RlcliError

BASE_URL = typer.Option(
    None, "--base-url", help="Server (default: $TINKER_BASE_URL, the one running here, :8000)."
)


def export(
    run: str = typer.Argument(
        None,
        metavar="RUN",
        help="A run, as `rlcli runs` takes it (its id, a unique prefix, or its folder): its "
        "last checkpoint.",
    ),
    checkpoint: str = typer.Option(
        None, "--checkpoint", "-c", help="tinker://RUN/(weights|sampler_weights)/NAME."
    ),
    output: Path = typer.Option(
        ..., "--output", "-o", help="Folder to write (new or empty); with --gguf, a .gguf file."
    ),
    merge: bool = typer.Option(
        False,
        "--merge",
        help="Merge the adapter into the base model: a transformers model folder "
        "(AutoModelForCausalLM.from_pretrained loads it; so does vLLM).",
    ),
    with_optimizer: bool = typer.Option(
        False,
        "--with-optimizer",
        help="A training state (weights/...) with its optimizer.pt and run.json, so "
        "`rlcli restore` can continue the run on another server.",
    ),
    gguf: bool = typer.Option(
        False,
        "--gguf",
        help="One .gguf file of the merged model (base + LoRA) for llama.cpp, Ollama, LM "
        "Studio: -o names the file. Llama (SmolLM2) and Qwen2/Qwen3 models.",
    ),
    gguf_type: str = typer.Option(
        "f16", "--gguf-type", help="With --gguf: f16, bf16 or q8_0 (weights' type)."
    ),
    base_model: str = typer.Option(
        None,
        "--base-model",
        help="With --merge/--gguf: where to load the base model from (default: the checkpoint's).",
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Replace an earlier export in the output folder (refused for any other folder).",
    ),
    base_url: str = BASE_URL,
    as_json: bool = JSON,
) -> None:
    """Export a checkpoint: a LoRA adapter folder in PEFT format, or with --merge a full model.

    Built beside -o DIR and renamed into place at the end: a failure leaves DIR as it was.

    DIR/rlcli_export.json records the source; `rlcli restore DIR` moves a --with-optimizer one.
    """
    from rlcli.client import export as exporting
    from rlcli.runs import catalog

    if bool(run) == bool(checkpoint):
        raise RlcliError("pass a RUN folder or --checkpoint tinker://... (one of them)")
    if gguf_type != "f16" and not gguf:
        raise RlcliError("--gguf-type: only with --gguf")
    exporting.check_flags(gguf, with_optimizer)
    path = checkpoint or catalog.checkpoint_path(run, with_optimizer)
    options = exporting.ExportOptions(
        merge=merge, with_optimizer=with_optimizer, gguf=gguf, gguf_type=gguf_type,
        base_model=base_model, force=force, base_url=base_url,
    )  # fmt: skip
    result = exporting.export_checkpoint(path, output, options, say=info)
    if gguf:
        if as_json:
            emit(result, as_json=True)
        else:
            emit({k: v for k, v in result.items() if k != "server"}, as_json=False, title="GGUF")
        return
    if as_json:
        emit(result, as_json=True)
        return
    files = result.pop("files")
    what = "merged model" if merge else "PEFT adapter"
    emit({k: v for k, v in result.items() if k != "server"}, as_json=False, title=what)
    emit([{"file": f["file"], "size": exporting.human(f["bytes"])} for f in files], as_json=False)


def restore(
    folder: Path = typer.Argument(..., help="A folder `rlcli export --with-optimizer` wrote."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace a checkpoint of that path already on the server."
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Accept a server whose base model has another name (same weights, another path).",
    ),
    base_url: str = BASE_URL,
    as_json: bool = JSON,
) -> None:
    """Put an exported training state on a server (rlcli's) under its original tinker:// path.

    The run continues there: `rlcli train sl --log-path RUN --base-url URL` resumes it.
    """
    from rlcli.client import endpoint
    from rlcli.client import export as exporting

    url, source = endpoint.resolve_base_url(base_url)
    endpoint.check_server(url, source=source, timeout=5)
    info(endpoint.describe(url, source))
    result = exporting.restore(url, folder, overwrite=overwrite, force=force, say=info)
    emit(result, as_json=as_json, title="restored")

"""``rlcli models``: base models that work offline."""

from __future__ import annotations

from pathlib import Path

import typer

from rlcli.cli._output import JSON, emit, info
from rlcli.errors import RlcliError

app = typer.Typer(
    help="Base models: the tiny offline test model, GGUF import.", no_args_is_help=True
)


@app.command("tiny")
def tiny(
    path: Path = typer.Argument(..., help="Folder to write the model and tokenizer into."),
    seed: int = typer.Option(0, help="Seed for the weights and the tokenizer corpus."),
    hidden_size: int = typer.Option(64, help="Width of the model."),
    layers: int = typer.Option(2, help="Number of transformer layers."),
    tools: bool = typer.Option(
        False, "--tools", help="A chat template with tools (Hermes/Qwen <tool_call> style)."
    ),
    as_json: bool = JSON,
) -> None:
    """Build a tiny Qwen3 model offline, for tests and smoke tests.

    A few hundred thousand parameters, a locally trained byte-level BPE tokenizer and a ChatML
    chat template; nothing is downloaded."""
    from rlcli.models.tiny import build_tiny_model

    info(f"building a tiny model in {path} ...")
    out = build_tiny_model(path, seed=seed, hidden_size=hidden_size, num_layers=layers, tools=tools)
    emit({"path": str(out), "serve": f"rlcli serve start --base-model {out}"}, as_json=as_json)


@app.command("import-gguf")
def import_gguf(
    gguf_file: Path = typer.Argument(..., help="A .gguf file (needs: pip install 'rlcli[gguf]')."),
    out: Path = typer.Argument(..., help="Folder to write the converted model into."),
    as_json: bool = JSON,
) -> None:
    """Convert a GGUF model to a transformers folder (weights dequantized to float32)."""
    import importlib.util

    from rlcli.models.gguf import check_gguf
    from rlcli.models.gguf import import_gguf as convert

    if not gguf_file.expanduser().is_file():
        raise RlcliError(f"{gguf_file}: no such GGUF file")
    if importlib.util.find_spec("gguf") is None:
        raise RlcliError(
            "models import-gguf needs the gguf package, which is not installed: "
            "pip install 'rlcli[gguf]'"
        )
    reader = check_gguf(gguf_file)  # a corrupt file is one line before anything is written
    info(f"converting {gguf_file} ...")
    folder = convert(gguf_file, out, reader)
    serve = f"rlcli serve start --base-model {folder}"
    emit({"path": str(folder), "serve": serve}, as_json=as_json)

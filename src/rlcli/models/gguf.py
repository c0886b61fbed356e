"""A ``.gguf`` file -> a cached ``save_pretrained`` folder, converted once (a temporary folder
renamed into place, so a killed conversion never leaves a half-written model)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rlcli.errors import RlcliError
from rlcli.models.names import (
    GGUF_CONVERSION,
    gguf_folder,
    is_gguf_file,
    is_local_model,
    resolve_model_name,
)
from rlcli.models.tokenizer import agree_special_tokens, byte_level_as_plain


def local_model(name: str, report=None) -> str:
    """``resolve_model_name``, converting a ``.gguf`` file into its cached folder first when
    that folder is not there yet (``report`` hears about the conversion)."""
    if is_gguf_file(name):
        return str(convert_gguf_cached(name, report))
    return resolve_model_name(name)


def convert_gguf_cached(gguf_file: str | os.PathLike[str], report=None) -> Path:
    """The converted folder of ``gguf_file``, converting it first if needed. The conversion
    writes a temporary folder and renames it into place, so a killed conversion never leaves a
    half-written model where the next run would load it."""
    source = Path(gguf_file).expanduser().resolve()
    if not source.is_file():
        raise RlcliError(f"{gguf_file}: no such GGUF file")
    target = gguf_folder(source)
    if is_local_model(str(target)):
        return target
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise RlcliError(
            f"{gguf_file}: reading a .gguf needs the gguf package: pip install 'rlcli[gguf]'"
        ) from None
    if report:
        report(f"converting {source.name} into {target} (once; later runs reuse it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        import_gguf(source, tmp)
        (tmp / "rlcli_gguf.json").write_text(
            json.dumps({"source": str(source), "conversion": GGUF_CONVERSION}) + "\n"
        )
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished the same conversion first
            if not is_local_model(str(target)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def import_gguf(gguf_file: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Convert a GGUF checkpoint (dequantized to float32) into a ``save_pretrained`` folder,
    which every part of the stack loads: the server, the SDK's tokenizer, the cookbook."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(gguf_file).expanduser().resolve()
    if not source.is_file():
        raise RlcliError(f"{gguf_file}: no such GGUF file")
    target = Path(out).expanduser().resolve()
    tokenizer = byte_level_as_plain(
        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    )
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, config=gguf_config(source)
    )
    agree_special_tokens(tokenizer, model.config, model.generation_config)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(target)
    model.save_pretrained(target)
    return target


def gguf_config(source: Path):
    """transformers' config of a GGUF file, with ``head_dim`` from the file's
    ``attention.key_length``: transformers (5.5) leaves Qwen3's at its default of 128, so a
    model whose heads are another size (``hidden / heads``, the tiny model's 16) would not
    load."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.attention.key_length")
    if field is not None and hasattr(config, "head_dim"):
        config.head_dim = int(field.contents())
    return config

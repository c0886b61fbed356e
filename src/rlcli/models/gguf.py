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
    reader = check_gguf(gguf_file)
    if report:
        report(f"converting {source.name} into {target} (once; later runs reuse it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        import_gguf(source, tmp, reader)
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


def import_gguf(
    gguf_file: str | os.PathLike[str], out: str | os.PathLike[str], reader=None
) -> Path:
    """Convert a GGUF checkpoint (dequantized to float32) into a ``save_pretrained`` folder,
    which every part of the stack loads: the server, the SDK's tokenizer, the cookbook.
    ``reader``: what ``check_gguf`` returned for the file, where the caller checked it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    source = Path(gguf_file).expanduser().resolve()
    reader = reader or check_gguf(gguf_file)
    target = Path(out).expanduser().resolve()
    verbosity = transformers_logging.get_verbosity()
    # its GGUF reader warns about fields it fills with defaults; a failure is our one line
    transformers_logging.set_verbosity_error()
    try:
        tokenizer = byte_level_as_plain(
            AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        )
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, config=gguf_config(source, reader)
        )
    except (ValueError, OSError, KeyError, IndexError, RuntimeError) as e:
        # a well-formed GGUF transformers cannot read: an unknown architecture, missing fields
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise RlcliError(f"{gguf_file}: cannot convert ({type(e).__name__}: {first})") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
    agree_special_tokens(tokenizer, model.config, model.generation_config)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(target)
    model.save_pretrained(target)
    return target


GGUF_MAGIC = b"GGUF"


def check_gguf(gguf_file: str | os.PathLike[str]):
    """Refuse, in one line naming the file, anything that is not a whole GGUF model: missing,
    empty, another format, a truncated header, no architecture or no tensors, a tensor whose
    data lies past the end. Every entry point that reads a user's ``.gguf`` (``serve start
    --base-model``, ``models import-gguf``, a ``.gguf`` teacher) converts through here, so no
    reader's IndexError or numpy ValueError reaches the user. Returns the file's
    ``gguf.GGUFReader`` (reading a 49k-token vocabulary's fields takes seconds: read once)."""
    path = Path(gguf_file).expanduser()
    if not path.is_file():
        raise RlcliError(f"{gguf_file}: no such GGUF file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if size == 0:
        raise RlcliError(f"{gguf_file}: the file is empty, not a GGUF model")
    if magic != GGUF_MAGIC:
        raise RlcliError(
            f"{gguf_file}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF')"
        )
    try:
        import gguf
    except ImportError:
        raise RlcliError(
            f"{gguf_file}: reading a .gguf needs the gguf package: pip install 'rlcli[gguf]'"
        ) from None
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader's numpy views fail in many ways on a cut file
        raise RlcliError(
            f"{gguf_file}: truncated or corrupt GGUF ({size} bytes; the reader says: "
            f"{type(e).__name__}: {str(e)[:120]})"
        ) from None
    if "general.architecture" not in reader.fields:
        raise RlcliError(f"{gguf_file}: a GGUF header without general.architecture (not a model)")
    if not reader.tensors:
        raise RlcliError(f"{gguf_file}: a GGUF file without tensors (not a model)")
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise RlcliError(
                f"{gguf_file}: tensor {tensor.name} lies past the end of the file ({size} bytes)"
            )
    return reader


def gguf_config(source: Path, reader=None):
    """transformers' config of a GGUF file, with ``head_dim`` from the file's
    ``attention.key_length``: transformers (5.5) leaves Qwen3's at its default of 128, so a
    model whose heads are another size (``hidden / heads``, the tiny model's 16) would not
    load. ``reader``: the file's ``gguf.GGUFReader`` where the caller has one."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    reader = reader or gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.attention.key_length")
    if field is not None and hasattr(config, "head_dim"):
        config.head_dim = int(field.contents())
    return config

"""Rows from the ``datasets`` library: a local parquet/arrow file or folder, or a Hugging Face
dataset id (``name`` or ``name:split``), for ``train sl --dataset``.

The rows come back as plain dicts, in order; the caller validates them as it validates a JSONL
file's lines (row N is "line N"), so a table gets the same checks and the same messages. The
hub is asked once, with a short timeout, before ``datasets`` (which retries for a long time
offline) is let at it: offline is one line, in seconds, naming what works without it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from rlcli.errors import RlcliError

TABLE_SUFFIXES = (".parquet", ".arrow")
# owner/name, optionally :split (a hub dataset id as the hub spells it)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
HUB_TIMEOUT_S = 5.0


def is_table(spec: str) -> bool:
    """Whether ``spec`` names a table rather than a JSONL file or stdin: a parquet/arrow file,
    a folder, or (not a path here) a hub id."""
    if spec == "-":
        return False
    path = Path(spec).expanduser()
    if path.is_dir():
        return True
    if path.exists():
        return path.suffix in TABLE_SUFFIXES
    return bool(HUB_ID.match(spec)) and path.suffix not in (".jsonl", ".json", *TABLE_SUFFIXES)


def read_rows(spec: str, flag: str = "--dataset") -> tuple[list[dict], str]:
    """(the rows, where they came from) for a table ``spec``; one line naming ``flag`` if
    it cannot be read."""
    path = Path(spec).expanduser()
    if path.exists():
        return _rows(_local(path, spec, flag)), f"{path.resolve()}"
    name, _, split = spec.partition(":")
    return _rows(_hub(name, split or "train", spec, flag)), f"hub:{name} ({split or 'train'})"


def _rows(table) -> list[dict]:
    return [dict(row) for row in table]


def _local(path: Path, spec: str, flag: str):
    import datasets

    try:
        if path.is_file():
            kind = path.suffix.lstrip(".")
            return datasets.load_dataset(kind, data_files=str(path), split="train")
        if any((path / f).exists() for f in ("dataset_info.json", "state.json")):
            return datasets.load_from_disk(str(path))  # Dataset.save_to_disk's folder
        if (path / "dataset_dict.json").exists():  # DatasetDict.save_to_disk's: its train split
            splits = datasets.load_from_disk(str(path))
            if "train" not in splits:
                raise RlcliError(
                    f"{flag} {spec}: no train split (it has: {', '.join(splits)}); "
                    "point at one split's folder"
                )
            return splits["train"]
        for suffix in TABLE_SUFFIXES:
            files = sorted(str(p) for p in path.rglob(f"*{suffix}"))
            if files:
                return datasets.load_dataset(suffix[1:], data_files=files, split="train")
    except RlcliError:
        raise
    except Exception as e:
        raise RlcliError(f"{flag} {spec}: cannot read it as a table ({_first(e)})") from None
    raise RlcliError(
        f"{flag} {spec}: a folder with no parquet or arrow files (and not a saved dataset)"
    )


def _hub(name: str, split: str, spec: str, flag: str):
    import datasets

    if not os.environ.get("HF_HUB_OFFLINE") and not os.environ.get("HF_DATASETS_OFFLINE"):
        _check_hub(name, spec, flag)
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:
        raise RlcliError(f"{flag} {spec}: cannot load it from the hub ({_first(e)})") from None


def _check_hub(name: str, spec: str, flag: str) -> None:
    """Ask the hub about ``name`` once, quickly: unreachable, or no such dataset, is one line."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().dataset_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise RlcliError(
            f"{flag} {spec}: a gated dataset; accept its terms on the hub and log in "
            "(hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise RlcliError(
            f"{flag} {spec}: no such file here, and no such dataset on the Hugging Face hub"
        ) from None
    except Exception as e:
        raise RlcliError(
            f"{flag} {spec}: no such file here, and the Hugging Face hub is unreachable "
            f"({_first(e)}); pass a JSONL file or a local parquet/arrow folder "
            "(or set HF_HUB_OFFLINE=1 to use a copy the datasets cache already holds)"
        ) from None


def _first(e: Exception) -> str:
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{type(e).__name__}: {line[:200]}"

"""GSM8K rows, from a local folder when one is given and from the hub otherwise.

The folder holds ``train.jsonl`` and ``test.jsonl`` exactly as openai/grade-school-math
publishes them (the same rows the hub's ``openai/gsm8k`` config ``main`` serves), so either
source yields identical problems.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlcli.errors import RlcliError

ENV_VAR = "RLCLI_GSM8K_DIR"
HUB_ID = "openai/gsm8k"


def resolve_dir(flag: str | None) -> Path | None:
    """The local folder from ``--gsm8k-dir`` or ``$RLCLI_GSM8K_DIR``; None means the hub."""
    value = flag or os.environ.get(ENV_VAR)
    if not value:
        return None
    folder = Path(value).expanduser()
    missing = [s for s in ("train.jsonl", "test.jsonl") if not (folder / s).is_file()]
    if missing:
        source = "--gsm8k-dir" if flag else f"${ENV_VAR}"
        raise RlcliError(f"{source} {value}: no {' or '.join(missing)} there")
    return folder.resolve()


def count_rows(folder: Path, split: str) -> int:
    """Problems in a folder's ``split`` file, without parsing them (for plans)."""
    with (folder / f"{split}.jsonl").open() as f:
        return sum(1 for line in f if line.strip())


def load_rows(folder: Path | None, split: str) -> list[dict]:
    """``[{"question", "answer"}, ...]`` for ``split`` ("train" or "test")."""
    if folder is not None:
        with (folder / f"{split}.jsonl").open() as f:
            return [json.loads(line) for line in f if line.strip()]
    hint = (
        f"offline, pass --gsm8k-dir FOLDER (or set ${ENV_VAR}) with train.jsonl and test.jsonl, "
        "or set HF_DATASETS_OFFLINE=1 to use a copy in the Hugging Face cache"
    )
    unreachable = _hub_unreachable()
    if unreachable:
        raise RlcliError(f"GSM8K: the Hugging Face hub is unreachable ({unreachable}); {hint}")
    try:
        from datasets import load_dataset

        ds = load_dataset(HUB_ID, name="main", split=split)
    except Exception as e:
        raise RlcliError(
            f"GSM8K: could not load {HUB_ID} from the hub ({type(e).__name__}); {hint}"
        ) from None
    return [{"question": r["question"], "answer": r["answer"]} for r in ds]


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached (one quick request), or None. ``datasets`` retries an
    unreachable hub for half a minute before it gives up; asked offline (``HF_HUB_OFFLINE`` /
    ``HF_DATASETS_OFFLINE``) it reads its cache, so nothing is asked then."""
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in _OFFLINE_VARS):
        return None
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        httpx.head(f"{endpoint.rstrip('/')}/api/datasets/{HUB_ID}", timeout=timeout)
    except httpx.HTTPError as e:
        return f"{endpoint}: {type(e).__name__}"
    return None


_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")

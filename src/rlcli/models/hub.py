"""Whether the Hugging Face hub can be asked, found out once with one quick request, and a
tokenizer loaded without asking it when it cannot.

Why: offline, ``from_pretrained`` of a hub id retries each file five times with backoff (over a
minute, a ``Retrying in 8s`` line each) before it fails; a tokenizer already in the cache loads
from it with ``local_files_only`` in milliseconds."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

HUB_PROBE_S = 3.0
_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_unreachable() -> str | None:
    """Why the hub cannot be asked (offline by the environment, or one request failed), or
    None. The request is made once per endpoint and process."""
    for var in _OFFLINE:
        if os.environ.get(var, "").lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    return _probe((os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/"))


@cache
def _probe(endpoint: str) -> str | None:
    import httpx

    try:
        httpx.head(endpoint, timeout=HUB_PROBE_S)
    except httpx.HTTPError as e:
        return f"{endpoint} unreachable ({type(e).__name__})"
    return None


def tokenizer(name: str):
    """``name``'s tokenizer as the cookbook loads it, or None: a local folder, a hub id when
    the hub answers, else a hub id from the cache alone (no retries), else None."""
    from tinker_cookbook import tokenizer_utils

    if Path(name).expanduser().exists() or hub_unreachable() is None:
        try:
            return tokenizer_utils.get_tokenizer(name)
        except Exception:  # no such repo, a gated one, a broken folder: the caller decides
            return None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "tokenizer_config.json")
    except Exception:  # not a repo id
        return None
    if not isinstance(cached, str):
        return None  # not in the cache: known without loading transformers' tokenizer classes
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # not in the cache
        return None

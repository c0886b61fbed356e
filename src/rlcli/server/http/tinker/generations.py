"""The tinker SDK generations this server speaks to, and every difference between them that the
server must honour: one place, so an SDK bump is one file to read and one test file to run
(``tests/test_generations.py``).

Two generations are served at once, by what a client says it is (``sdk_version`` at
``create_session``; the ``X-Stainless-Package-Version`` header on REST calls, which carry no
session):

- legacy, tinker 0.25 up to 0.37: ``stop: []`` stops at EOS like ``stop: None``; it never sends
  the 0.38 request fields, and its strict response models reject values it does not know (a
  checkpoint of type ``external`` in a list), so it never sees them.
- current, tinker 0.38 (and a client that does not say): ``stop: []`` means no stop at all, not
  even EOS; the 0.38 fields (``NEW_SAMPLE_FIELDS``, create via load, external weights, session
  finish) are served.

Responses carry the union of both generations' fields where the older one ignores extras
(``sample_sequence_ids`` on every ``asample`` future, for instance).
"""

from __future__ import annotations

import re

CURRENT = (0, 38)  # the newest generation served; what `rlcli` itself installs
OLDEST = (0, 25)

# Request fields of ``asample`` that only a current client sends (0 / None / False: unset).
NEW_SAMPLE_FIELDS = (
    "topk_sample_logprobs",
    "target_prompt_logprobs",
    "prompt_alt_tokens_k",
    "prompt_logprobs_last_n",
)

# The 0.38 features behind `/client/config` flags that this server does not implement: the
# client keeps its older path (per-request polling, client-side custom losses, random clone ids).
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # plain X-API-Key, no JWT exchange
    "use_pyqwest_transport": False,  # httpx (0.38 would default to pyqwest)
    "proto_compress_fwdbwd": False,  # loopback: compression only costs CPU
    "parallel_fwdbwd_chunks": True,
    "create_model_via_load_weights": False,  # 0.25's flag: its create-then-load path
    "sample_no_retries": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
LEGACY_FLAGS = ("create_model_via_load_weights",)  # in 0.25's schema, gone from 0.38's

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)")


def parse(version: str | None) -> tuple[int, int] | None:
    """``"0.25.0"`` -> ``(0, 25)``; None for anything else (treated as current)."""
    match = _VERSION.match(version or "")
    return (int(match[1]), int(match[2])) if match else None


def is_legacy(version: str | None) -> bool:
    """True for a client of the 0.25 generation (0.25 up to 0.37)."""
    parsed = parse(version)
    return parsed is not None and parsed < CURRENT


def header_version(headers) -> str | None:
    """The SDK version a REST call names in its headers (every generation sends it)."""
    return headers.get("x-stainless-package-version")


def needs_current(field: str, version: str | None) -> str | None:
    """The refusal for a current-only ``field`` sent by a legacy session, else None."""
    if not is_legacy(version):
        return None
    return (
        f"{field}: needs a tinker>={CURRENT[0]}.{CURRENT[1]} client; this session was created "
        f"by tinker {version}"
    )

"""A client of rlcli's doc-to-LoRA routes (``server/http/d2l.py``): create, train, save and
load a hypernetwork on a server's base model, and internalize documents with one.

Only rlcli's torch server has these routes; ``Hypernets(base_url)`` asks the server's
capabilities first and refuses any other server (SkyRL, hosted Tinker) in one line, before a
run folder exists. Every server refusal arrives as one ``RlcliError`` line with its reason.
"""

from __future__ import annotations

from typing import Any

import httpx

from rlcli.client import endpoint, server_info
from rlcli.errors import RlcliError

ROUTES = "/api/v1/rlcli"
TIMEOUT_S = 600.0  # one step or internalization of a long document on a slow CPU


def check_hosts_hypernets(server: server_info.Server) -> None:
    if not server.caps.get("hypernetworks"):
        backend = server.backend or "this server"
        raise RlcliError(
            f"the server at {server.base_url} ({backend}) hosts no hypernetworks: doc-to-LoRA "
            "runs on rlcli's own server (rlcli serve start --base-model ...)"
        )


class Hypernets:
    def __init__(self, base_url: str) -> None:
        self.server = server_info.Server(base_url)
        check_hosts_hypernets(self.server)
        self.base_url = self.server.base_url

    def _post(self, path: str, body: dict | None = None, method: str = "POST") -> dict:
        url = f"{self.base_url}{ROUTES}{path}"
        try:
            response = httpx.request(
                method, url, json=body, headers=endpoint.headers(), timeout=TIMEOUT_S
            )
        except httpx.HTTPError as e:
            raise RlcliError(f"no answer from {url} ({type(e).__name__})") from None
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except (ValueError, AttributeError):
                detail = response.text[:300]
            raise RlcliError(f"refused by the server ({response.status_code}): {detail}")
        return response.json()

    def create(self, model: str | None = None, seed: int | None = None, **settings) -> dict:
        return self._post("/hypernets", {"base_model": model, "seed": seed, **settings})

    def step(
        self, hypernet_id: str, examples: list[dict], lr: float, l1: float = 0.0,
        train: bool = True,
    ) -> dict:  # fmt: skip
        body = {"examples": examples, "lr": lr, "l1": l1, "train": train}
        return self._post(f"/hypernets/{hypernet_id}/step", body)

    def save(self, hypernet_id: str, name: str) -> dict:
        return self._post(f"/hypernets/{hypernet_id}/save", {"name": name})

    def load(self, path: str, hypernet_id: str | None = None, optimizer: bool = True) -> dict:
        body = {"path": path, "hypernet_id": hypernet_id, "optimizer": optimizer}
        return self._post("/hypernets/load", body)

    def remove(self, hypernet_id: str) -> dict:
        return self._post(f"/hypernets/{hypernet_id}", method="DELETE")

    def internalize(
        self, hypernet: str, document: str, *, name: str | None = None,
        session_key: str | None = None, ttl_seconds: int | None = None, pin: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """The document's adapter: ``{"path": tinker://.../sampler_weights/..., "seconds",
        "tokens", "chunks", "rank", "reused", "expires_at"}``."""
        body = {
            "hypernet": hypernet, "document": document, "name": name,
            "session_key": session_key, "ttl_seconds": ttl_seconds, "pin": pin,
        }  # fmt: skip
        return self._post("/internalize", body)


def read_document(document: str, stdin=None) -> str:
    """A document file's text (``-``: stdin); one line when it is missing or unreadable."""
    import sys
    from pathlib import Path

    if document == "-":
        return (stdin or sys.stdin).read()
    path = Path(document).expanduser()
    if not path.is_file():
        raise RlcliError(f"{document}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RlcliError(f"{document}: not UTF-8 text") from None


HYPERNET_KIND = "hypernet_weights"
DEFAULT_TTL_S = 86_400  # the server's (server/http/d2l.py): an unused adapter lives a day
HYPERNET_HELP = "tinker://ID/hypernet_weights/NAME (rlcli train d2l prints it as hypernet_path)"


def check_hypernet_path(path: str, flag: str = "--hypernet") -> None:
    """``path`` names a hypernetwork checkpoint: one line otherwise (an adapter's path says it
    is an adapter), before any server is asked."""
    run_id, _, rest = path.removeprefix("tinker://").partition("/")
    kind, _, name = rest.partition("/")
    if path.startswith("tinker://") and kind == HYPERNET_KIND and run_id and name:
        return
    what = "not a hypernetwork path"
    if path.startswith("tinker://") and kind in ("sampler_weights", "weights"):
        what = f"a {kind} checkpoint (a LoRA adapter), not a hypernetwork"
    raise RlcliError(f"{flag} {path}: {what}; expected {HYPERNET_HELP}")


def internalize_text(
    text: str, hypernet: str, *, base_url: str | None = None, name: str | None = None,
    session_key: str | None = None, ttl_seconds: int | None = None, pin: bool = False,
    what: str = "the document", model: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A document's text into a sampler checkpoint with one forward pass of ``hypernet`` on
    the server (``base_url``, else the one found): what ``rlcli hypernet internalize`` and
    ``rlcli internalize --hypernet`` both do. The server's answer (``path``, ``tokens``,
    ``chunks``, ``rank``, ``reused``, ``expires_at``); every refusal one line. ``model``:
    the base model the caller expects, checked against the server's."""
    check_hypernet_path(hypernet)
    if pin and ttl_seconds is not None:
        raise RlcliError("--ttl with --pin: a pinned adapter never expires; give one of them")
    if not text.strip():
        raise RlcliError(f"{what}: the document is empty")
    url, source = endpoint.resolve_base_url(base_url)
    endpoint.check_server(url, source=source)
    hypernets = Hypernets(url)
    if model:
        hypernets.server.check_model(model)
    return hypernets.internalize(
        hypernet, text, name=name, session_key=session_key, ttl_seconds=ttl_seconds, pin=pin
    )


def internalize(
    document: str, hypernet: str, *, base_url: str | None = None, name: str | None = None,
    session_key: str | None = None, ttl_seconds: int | None = None, pin: bool = False,
    stdin=None,
) -> dict[str, Any]:  # fmt: skip
    """``rlcli hypernet internalize``: a document file (or ``-``) into a sampler checkpoint
    (``internalize_text``). The checkpoint is sampled like any other (``rlcli sample
    --checkpoint PATH``, ``/v1`` with ``model=PATH``, export)."""
    check_hypernet_path(hypernet)
    return internalize_text(
        read_document(document, stdin), hypernet, base_url=base_url, name=name,
        session_key=session_key, ttl_seconds=ttl_seconds, pin=pin, what=document,
    )  # fmt: skip

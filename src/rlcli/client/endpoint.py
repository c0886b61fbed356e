"""Which Tinker server a command talks to, and the checks made before talking to it.

Every command resolves the server the same way (``resolve_base_url``): ``--base-url``, then
``$TINKER_BASE_URL``, then the server ``rlcli serve`` runs here (``$RLCLI_HOME/server.json``),
then http://localhost:8000. Every request rlcli makes itself (not through the SDK) sends the API
key the SDK would send (``api_key``), and every HTTP failure becomes one ``RlcliError`` line:
the SDK retries a dead server for minutes and prints tracebacks, so rlcli asks first.
"""

from __future__ import annotations

import os

import httpx

from rlcli.errors import RlcliError

DEFAULT_URL = "http://localhost:8000"
DEFAULT_API_KEY = "tml-dummy"  # = pins.DEFAULT_API_KEY (not imported: that loads tinker)
LOADING = "loading the base model"  # what our server's healthz says while it loads


def api_key() -> str:
    """The key the tinker SDK sends: ``$TINKER_API_KEY``, else ``tml-dummy``."""
    return os.environ.get("TINKER_API_KEY") or DEFAULT_API_KEY


def headers() -> dict[str, str]:
    return {"X-API-Key": api_key()}


def resolve_base_url(flag: str | None) -> tuple[str, str]:
    """(url, where it came from): --base-url, $TINKER_BASE_URL, the server running here, default."""
    if flag:
        return flag.rstrip("/"), "--base-url"
    if os.environ.get("TINKER_BASE_URL"):
        return os.environ["TINKER_BASE_URL"].rstrip("/"), "$TINKER_BASE_URL"
    from rlcli.home import rlcli_home
    from rlcli.launch import process

    record, _ = process.live_record(rlcli_home())
    if record is not None:
        return record.base_url, f"the server running here, pid {record.pid}"
    return DEFAULT_URL, "the default"


def describe(url: str, source: str) -> str:
    """One line for the start of a run: which server, and why that one."""
    return f"server: {url} ({source})"


def check_server(
    url: str, *, model: str | None = None, source: str | None = None, timeout: float = 5.0
) -> None:
    """Raise one ``RlcliError`` line unless a Tinker server at ``url`` answers and accepts our
    API key. A server still loading its model passes (the SDK waits for it)."""
    where = f" (from {source})" if source and source != "--base-url" else ""
    start = f"rlcli serve start --base-model {model}" if model else "rlcli serve start"
    try:
        response = httpx.get(f"{url}/api/v1/healthz", timeout=timeout)
    except httpx.HTTPError as e:
        raise RlcliError(
            f"no Tinker server answered at {url}{where} ({type(e).__name__}); "
            f"start one with `{start}` or pass --base-url"
        ) from None
    if response.status_code not in (200, 404):  # 404: no health route (SkyRL); ask below
        detail = _detail(response)
        if detail != LOADING:
            raise RlcliError(f"the Tinker server at {url}{where} is not healthy: {detail}")
    _get(url, "/api/v1/get_server_capabilities", timeout)  # is our key accepted? (healthz is open)


def get_json(url: str, path: str, *, timeout: float = 10.0) -> dict:
    """GET ``url + path`` with our API key; the JSON body, or one ``RlcliError`` line."""
    response = _get(url, path, timeout)
    if response.status_code >= 400:
        raise RlcliError(f"{url}{path} answered HTTP {response.status_code}: {_detail(response)}")
    try:
        body = response.json()
    except ValueError:
        raise RlcliError(f"{url}{path} answered something that is not JSON") from None
    return body if isinstance(body, dict) else {"value": body}


def _get(url: str, path: str, timeout: float) -> httpx.Response:
    """The response; ``RlcliError`` if nothing answers or the server refuses our API key."""
    try:
        response = httpx.get(f"{url}{path}", headers=headers(), timeout=timeout)
    except httpx.HTTPError as e:
        raise RlcliError(f"no answer from {url}{path} ({type(e).__name__})") from None
    if response.status_code in (401, 403):
        raise RlcliError(
            f"the server at {url} refused the API key (HTTP {response.status_code}: "
            f"{_detail(response)}); set TINKER_API_KEY to the key it was started with"
        )
    return response


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail or response.reason_phrase or response.status_code)[:300]

"""Which Tinker server a command talks to, and the checks made before talking to it.

Every command resolves the server the same way (``resolve_base_url``): ``--base-url``, then
``$TINKER_BASE_URL``, then the server ``rlcli serve`` runs here (``$RLCLI_HOME/server.json``),
then http://localhost:8000. Every request rlcli makes itself (not through the SDK) sends the API
key the SDK would send (``api_key``), and every HTTP failure becomes one ``RlcliError`` line:
the SDK retries a dead server for minutes and prints tracebacks, so rlcli asks first.
"""

from __future__ import annotations

import os
import time

import httpx

from rlcli.errors import RlcliError
from rlcli.home import rlcli_home
from rlcli.launch import process

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

    record, _ = process.live_record(rlcli_home())
    if record is not None:
        return record.base_url, f"the server running here, pid {record.pid}"
    return DEFAULT_URL, "the default"


def describe(url: str, source: str) -> str:
    """One line for the start of a run: which server, and why that one."""
    return f"server: {url} ({source})"


PROBE_TIMEOUT_S = 5.0  # the most the probe of a server waits in all (docs/troubleshooting.md)
PROBE_BYTES = 1 << 16  # a Tinker server's health and capabilities answers are far smaller


def check_server(
    url: str,
    *,
    model: str | None = None,
    source: str | None = None,
    timeout: float | None = None,
) -> None:
    """Raise one ``RlcliError`` line unless a Tinker server at ``url`` answers and accepts our
    API key; every command that talks to a server asks here first, and gives up within
    ``timeout`` seconds in all (default ``$RLCLI_PROBE_TIMEOUT_S``, else 5). A server still
    loading its model passes (the SDK waits for it). What answers must answer as a Tinker
    server does, ``get_server_capabilities`` as JSON with ``supported_models`` (the SDK's one
    required field): the SDK and the ``tinker`` CLI would retry a web server's 404s or HTML
    for minutes."""
    where = f" (from {source})" if source and source != "--base-url" else ""
    start = f"rlcli serve start --base-model {model}" if model else "rlcli serve start"
    timeout = timeout or probe_timeout()
    deadline = time.monotonic() + timeout
    try:
        health = _probe(f"{url}/api/v1/healthz", deadline)
    except httpx.HTTPError as e:
        raise RlcliError(
            f"no Tinker server answered at {url}{where} within {timeout:g} s "
            f"({type(e).__name__}); start one with `{start}` or pass --base-url"
        ) from None
    loading = _detail(health) == LOADING
    if health.status_code not in (200, 404) and not loading:  # 404: no health route (SkyRL)
        if _json_detail(health) is None:
            raise _not_tinker(url, where, "/api/v1/healthz", health)
        raise RlcliError(f"the Tinker server at {url}{where} is not healthy: {_detail(health)}")
    path = "/api/v1/get_server_capabilities"
    try:
        caps = _probe(f"{url}{path}", deadline, headers())
    except httpx.HTTPError as e:
        raise RlcliError(
            f"what answers at {url}{where} gave no answer to {path} within {timeout:g} s "
            f"({type(e).__name__}): not a Tinker server, or a stuck one; check --base-url"
        ) from None
    _refused_key(url, caps)
    if loading and caps.status_code == 503:
        return
    try:
        body = caps.json() if caps.status_code == 200 else None
    except ValueError:
        body = None
    if not (isinstance(body, dict) and isinstance(body.get("supported_models"), list)):
        raise _not_tinker(url, where, path, caps)


def probe_timeout() -> float:
    """``$RLCLI_PROBE_TIMEOUT_S`` (a far or slow server), else ``PROBE_TIMEOUT_S``."""
    raw = os.environ.get("RLCLI_PROBE_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else PROBE_TIMEOUT_S
    except ValueError:
        raise RlcliError(f"RLCLI_PROBE_TIMEOUT_S={raw}: not a number of seconds") from None
    if not 0 < value < 3600:
        raise RlcliError(f"RLCLI_PROBE_TIMEOUT_S={raw}: give seconds between 0 and 3600")
    return value


def _probe(url: str, deadline: float, with_headers: dict | None = None) -> httpx.Response:
    """GET ``url`` before ``deadline`` (httpx's timeout is per read, so a server that trickles
    bytes would hold it forever), reading at most ``PROBE_BYTES``."""
    timeout = max(deadline - time.monotonic(), 0.01)
    with httpx.stream("GET", url, headers=with_headers, timeout=timeout) as response:
        body = b""
        for chunk in response.iter_raw():
            body += chunk
            if len(body) > PROBE_BYTES or time.monotonic() > deadline:
                break
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout("no whole answer in time")
    return httpx.Response(
        response.status_code, headers=response.headers, content=body, request=response.request
    )


def _not_tinker(url: str, where: str, path: str, response: httpx.Response) -> RlcliError:
    kind = response.headers.get("content-type", "no content type").split(";")[0]
    return RlcliError(
        f"what answers at {url}{where} is not a Tinker server ({path} answered HTTP "
        f"{response.status_code}, {kind}); check --base-url or TINKER_BASE_URL"
    )


def _refused_key(url: str, response: httpx.Response) -> None:
    if response.status_code in (401, 403):
        raise RlcliError(
            f"the server at {url} refused the API key (HTTP {response.status_code}: "
            f"{_detail(response)}); set TINKER_API_KEY to the key it was started with"
        )


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
    _refused_key(url, response)
    return response


def _json_detail(response: httpx.Response):
    """The ``detail`` of a JSON error body (as FastAPI and our server write them), or None."""
    try:
        return response.json().get("detail")
    except (ValueError, AttributeError):
        return None


def _detail(response: httpx.Response) -> str:
    detail = _json_detail(response)
    return str(detail or response.reason_phrase or response.status_code)[:300]

"""A URL where something other than a Tinker server answers: a web server's 404s and HTML, or a
listener that never answers. Every command that talks to a server asks one probe first
(``client/endpoint.check_server``), which gives up within ``$RLCLI_PROBE_TIMEOUT_S`` (5 s by
default; 1 s here) with one line, instead of leaving the SDK or the ``tinker`` CLI to retry.

Real sockets on 127.0.0.1; the commands run in-process (each refuses before any SDK call)."""

from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path

import pytest

from conftest import cli


class _WebPage(http.server.BaseHTTPRequestHandler):
    """A plain web server: HTML for /, a 404 HTML page for everything else."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        page = b"<html><body>Not Found</body></html>"
        self.send_response(200 if self.path == "/" else 404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    do_POST = do_GET

    def log_message(self, *args):
        pass


class _HealthyButNotTinker(_WebPage):
    """Answers 200 JSON everywhere, as a generic JSON API might: healthz passes, the
    capabilities lack ``supported_models``."""

    def do_GET(self):  # noqa: N802
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve(handler) -> tuple[str, http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", httpd


@pytest.fixture(scope="module")
def web_page():
    url, httpd = _serve(_WebPage)
    yield url
    httpd.shutdown()


@pytest.fixture(scope="module")
def json_api():
    url, httpd = _serve(_HealthyButNotTinker)
    yield url
    httpd.shutdown()


@pytest.fixture(scope="module")
def silent():
    """A listener that never accepts: the kernel completes connections, nothing answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _commands(url: str, tmp: Path) -> dict[str, list[str]]:
    chats = Path(__import__("tinker_cookbook").__file__).parent / "example_data"
    return {
        "checkpoint list": ["checkpoint", "list", "--base-url", url],
        "run list": ["run", "list", "--base-url", url],
        "alias list": ["alias", "list", "--base-url", url],
        "sample": ["sample", "--base-url", url, "--model", "org/m", "-p", "hi"],
        "train sl": [
            "train", "sl", "--base-url", url, "--model", "org/m", "--log-path", str(tmp / "r"),
            "--dataset", str(chats / "conversations.jsonl"), "--max-steps", "1",
        ],
        "eval rl": [
            "eval", "rl", "--base-url", url, "--model", "org/m", "--env", "arithmetic",
            "--tasks", "2",
        ],
        "export": [
            "export", "--base-url", url, "--checkpoint", "tinker://r/sampler_weights/1",
            "-o", str(tmp / "out"),
        ],
    }  # fmt: skip


COMMANDS = list(_commands("", Path()))
ENV = {"RLCLI_PROBE_TIMEOUT_S": "1", "TINKER_BASE_URL": ""}


def _one_error(result) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_web_server_is_named_not_a_tinker_server(command, web_page, tmp_path):
    args = _commands(web_page, tmp_path)[command]
    line = _one_error(cli(*args, env={**ENV, "RLCLI_HOME": str(tmp_path)}))
    assert line == (
        f"error: what answers at {web_page} is not a Tinker server "
        "(/api/v1/get_server_capabilities answered HTTP 404, text/html); "
        "check --base-url or TINKER_BASE_URL"
    )
    assert not (tmp_path / "r").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["checkpoint list", "train sl"])
def test_a_json_api_without_the_capabilities_is_not_a_tinker_server(command, json_api, tmp_path):
    args = _commands(json_api, tmp_path)[command]
    line = _one_error(cli(*args, env={**ENV, "RLCLI_HOME": str(tmp_path)}))
    assert "is not a Tinker server (/api/v1/get_server_capabilities answered HTTP 200" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_server_that_never_answers_is_given_up_on_within_the_stated_time(
    command, silent, tmp_path
):
    args = _commands(silent, tmp_path)[command]
    line = _one_error(cli(*args, env={**ENV, "RLCLI_HOME": str(tmp_path)}))
    assert line.startswith(f"error: no Tinker server answered at {silent} within 1 s (ReadTimeout)")


def test_the_probe_timeout_must_be_seconds(web_page, tmp_path):
    env = {"RLCLI_PROBE_TIMEOUT_S": "soon", "RLCLI_HOME": str(tmp_path)}
    line = _one_error(cli("checkpoint", "list", "--base-url", web_page, env=env))
    assert line == "error: RLCLI_PROBE_TIMEOUT_S=soon: not a number of seconds"

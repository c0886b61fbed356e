"""How the server behaves over time: compute never blocks HTTP, vanished clients are cleaned
up. (The foreground mode serving until SIGTERM: test_serve_cli.py's foreground test.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import tinker
from tinker import types

from rlcli.launch import process


def test_health_and_polls_stay_fast_during_a_long_forward_backward(server, service, tiny_model):
    trainer = service.create_lora_training_client(base_model=str(tiny_model), rank=8).result()
    big = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5 + i % 900 for i in range(2048)]),
            loss_fn_inputs={"target_tokens": [6] * 2048, "weights": [1.0] * 2048},
        )
        for _ in range(8)  # seconds of compute on CI's 2 cores: polls see it busy many times
    ]
    started = time.monotonic()
    future = trainer.forward_backward(big, "cross_entropy")
    latencies, busy_seen = [], 0
    with httpx.Client(base_url=server.base_url) as http:
        while not future._future.done() and time.monotonic() - started < 120:
            t0 = time.perf_counter()
            assert http.get("/api/v1/healthz").status_code == 200
            latencies.append(time.perf_counter() - t0)
            busy_seen += http.get("/rlcli/status").json()["pending_requests"] > 0
            time.sleep(0.05)
    future.result()
    assert busy_seen >= 3, "the forward pass finished too fast to show anything"
    assert max(latencies) < 0.5, latencies


def test_an_idle_keep_alive_connection_outlives_the_clients_5_s(server):
    """A connection idle past httpx's 5 s keep-alive (the tinker SDK's and openai's pool) is
    still open on the server side: the client drops it first, so no request is ever sent on a
    connection the server is closing (uvicorn's default 5 s raced it)."""
    from http.client import HTTPConnection

    from rlcli.server.__main__ import KEEP_ALIVE_S

    assert KEEP_ALIVE_S > 5
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=10)
    try:
        sockets = []
        for pause in (0, 6):  # 6: past the client's keep-alive; the server kept it open
            time.sleep(pause)
            conn.request("GET", "/api/v1/healthz")
            sockets.append(conn.sock)  # the one connection, unless it had been closed
            answer = conn.getresponse()  # RemoteDisconnected: the server had closed it
            assert answer.status == 200, (pause, answer.status)
            answer.read()  # the whole body, so the next answer starts clean
        assert sockets[0] is sockets[1]
    finally:
        conn.close()


def test_a_vanished_clients_adapters_are_freed(tmp_path, tiny_model):
    from conftest import start_server

    record = start_server(tmp_path, tiny_model, session_timeout=2.0)
    try:
        script = textwrap.dedent(f"""
            import os, tinker
            service = tinker.ServiceClient(base_url="{record.base_url}", api_key="tml-dummy")
            trainer = service.create_lora_training_client(
                base_model="{tiny_model}", rank=4
            ).result()
            print(trainer.model_id, flush=True)
            os._exit(0)  # no goodbye: heartbeats just stop
        """)
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        model_id = out.stdout.strip().splitlines()[-1]
        status = httpx.get(f"{record.base_url}/rlcli/status").json()
        assert status["models"] == 1
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and status["models"]:
            time.sleep(0.5)
            status = httpx.get(f"{record.base_url}/rlcli/status").json()
        assert status["models"] == 0 and status["sessions"] == 0
        service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
        info = tinker.types.GetInfoResponse(model_data=tinker.types.ModelData(), model_id=model_id)
        ghost = tinker.TrainingClient(service.holder, model_seq_id=0, model_id=model_id, info=info)
        with pytest.raises(tinker.NotFoundError):
            ghost.forward(
                [
                    types.Datum(
                        model_input=types.ModelInput.from_ints([5]),
                        loss_fn_inputs={"target_tokens": [6]},
                    )
                ],
                "cross_entropy",
            ).result()
    finally:
        process.stop(tmp_path)

"""If the engine process dies, nothing waits forever: pending requests fail with the reason,
new ones get a 503 the SDK does not retry, health says why, and the server exits non-zero a
few seconds later so a supervisor brings up a fresh one. A stop sent while the engine gathers
a sampling batch ends it at once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from conftest import cli, start_server
from rlcli.launch import pids


def _engine_pid(server_pid: int) -> int:
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in map(int, children):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine process under {server_pid}: {children}")


def test_a_dead_engine_fails_every_request_fast_and_the_server_exits(tmp_path, tiny_model):
    home = tmp_path / "home"
    record = start_server(home, tiny_model)
    service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    # A request that is still running when the engine dies (a long decode).
    pending = sampler.sample(prompt, 8, types.SamplingParams(max_tokens=3000, seed=0))
    # And an OpenAI stream mid-answer: it must end with an error event, not be cut.
    frames: list[str] = []
    streaming = threading.Event()
    # ignore_eos: the tiny model may draw EOS, and end the stream, long before the kill.
    body = {"model": str(tiny_model), "prompt": [5, 6], "max_tokens": 3000, "stream": True}
    body["ignore_eos"] = True

    def read_stream() -> None:
        with httpx.stream("POST", f"{record.base_url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    frames.append(line)
                    streaming.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert streaming.wait(30)
    time.sleep(0.5)
    os.kill(_engine_pid(record.pid), signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="engine"):
        pending.result(timeout=30)
    assert time.monotonic() - started < 10
    reader.join(30)
    assert len(frames) > 2 and json.loads(frames[0].removeprefix("data: "))["choices"]
    last = json.loads(frames[-1].removeprefix("data: "))
    assert last["error"]["type"] == "server_error" and "engine" in last["error"]["message"]
    health = httpx.get(record.base_url + "/api/v1/healthz", timeout=5)
    assert health.status_code == 503 and "engine" in health.json()["detail"]
    late = httpx.post(
        record.base_url + "/api/v1/asample",
        json={"prompt": {"chunks": [{"tokens": [5]}]}, "base_model": str(tiny_model)},
        headers={"X-API-Key": "tml-dummy"},
        timeout=5,
    )
    assert late.status_code == 503 and late.headers.get("x-should-retry") == "false"
    assert "engine unavailable" in late.json()["detail"]
    deadline = time.monotonic() + 20
    while pids.pid_alive(record.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pids.pid_alive(record.pid), "the server should exit after the engine died"
    log = Path(record.log_path).read_text()
    assert "the engine process exited" in log
    status = cli("serve", "status", "--json", env={"RLCLI_HOME": str(home)})
    assert status.returncode == 3
    report = json.loads(status.stdout)
    assert report["running"] is False and "engine process exited" in report["last_error"]


def test_a_stop_during_sample_gathering_ends_the_engine(tiny_model):
    """Before: the stop arriving right behind a sample request was dropped by the gatherer,
    and the engine lingered until killed."""
    from rlcli.server.engine import ops
    from rlcli.server.engine.sampling import SampleJob
    from rlcli.server.state.engine_client import EngineClient
    from rlcli.server.state.futures import FutureStore

    futures = FutureStore()
    futures.bind(asyncio.new_event_loop())  # replies are queued on it; nobody waits here
    client = EngineClient({"base_model": str(tiny_model), "device": "cpu"}, futures)
    client.start()
    assert client.ready.wait(120) and client.healthy, client.error
    job = SampleJob(prompt=np.asarray([5, 6, 7]), max_tokens=2)
    client._requests.put(("r1", ops.Sample(job)))
    client._requests.put(None)  # the stop, right behind it: inside the gathering window
    client._process.join(15)
    assert not client._process.is_alive()
    assert client._process.exitcode == 0

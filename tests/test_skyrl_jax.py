"""SkyRL 0.4.0's jax backend, live on the tiny model: ``rlcli serve start --backend jax``
installs it (once; cached in ``$RLCLI_SKYRL_CACHE``, default ``~/.cache/rlcli-tests/skyrl``,
about 6 GB, a minute or two from nothing) and serves; ``train sl`` and ``train rl --loss
importance_sampling`` run end to end against it; gspo is refused before any rollout; the compat
adaptations hold; ``serve stop`` leaves no process behind, also after the engine died first."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import cli, run_rlcli
from rlcli.compat import distill, skyrl_client
from rlcli.launch import pids, process

pytestmark = pytest.mark.slow

# One user adapter at a time (jax keeps slot 0 for the base model): every run must free its
# training client when it ends (skyrl_client.release_adapters_at_exit) for the next one to start.
BACKEND_CONFIG = {"max_lora_adapters": 2}


@pytest.fixture(scope="module")
def skyrl_env(tmp_path_factory):
    cache = os.environ.get("RLCLI_SKYRL_CACHE") or str(Path.home() / ".cache/rlcli-tests/skyrl")
    home = tmp_path_factory.mktemp("skyrl-home")
    # What a server start compiles is kept for the next: jax's persistent compilation cache
    # (its own env flags), and Python's bytecode where the environment turned it off
    # (PYTHONDONTWRITEBYTECODE=1 in CI's image; empty = unset), so the engine process and the
    # module's second server import SkyRL's environment from .pyc files the first one wrote
    compiled = tmp_path_factory.mktemp("jax-compiled")
    kept = {
        "JAX_COMPILATION_CACHE_DIR": str(compiled),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "PYTHONDONTWRITEBYTECODE": "",
    }
    return {"RLCLI_HOME": str(home), "RLCLI_SKYRL_CACHE": cache, **kept}


def start(env: dict, model: Path) -> process.ServerRecord:
    from rlcli.demo.run import free_port

    result = run_rlcli(
        "serve", "start", "--backend", "jax", "--base-model", str(model),
        "--port", str(free_port()), "--backend-config", json.dumps(BACKEND_CONFIG),
        "--wait", "900", "--json", env=env, timeout=3600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    record = process.read_record(Path(env["RLCLI_HOME"]))
    assert record is not None and json.loads(result.stdout)["base_url"] == record.base_url
    return record


@pytest.fixture(scope="module")
def skyrl_server(skyrl_env, tiny_model):
    record = start(skyrl_env, tiny_model)
    yield record
    cli("serve", "stop", env=skyrl_env)


def alive(members: dict[int, int | None]) -> list[int]:
    return [p for p, t in members.items() if pids.pid_alive(p) and pids.start_ticks(p) == t]


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def test_status_and_logs_see_the_skyrl_server(skyrl_server, skyrl_env):
    status = cli("serve", "status", "--json", env=skyrl_env)
    assert status.returncode == 0, status.stdout + status.stderr
    body = json.loads(status.stdout)
    assert body["backend"] == "jax" and body["healthy"] and body["pid"] == skyrl_server.pid
    logs = cli("serve", "logs", "-n", "400", env=skyrl_env)
    assert "Initialized TinkerEngine" in logs.stdout
    # bound to loopback, database and checkpoints in rlcli's home
    command = skyrl_server.command
    assert command[command.index("--host") + 1] == "127.0.0.1"
    home = skyrl_env["RLCLI_HOME"]
    assert command[command.index("--database-url") + 1] == f"sqlite:///{home}/skyrl/tinker.db"
    assert (Path(home) / "skyrl" / "tinker.db").exists()


def test_train_sl_then_rl_importance_sampling_end_to_end(skyrl_server, skyrl_env, tiny_model):
    import tinker_cookbook

    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    home = Path(skyrl_env["RLCLI_HOME"])
    sl = cli(
        "train", "sl", "--dataset", str(conversations), "--model", str(tiny_model),
        "--base-url", skyrl_server.base_url, "--log-path", str(home / "sl"),
        "--batch-size", "4", "--max-steps", "3", "--json", env=skyrl_env,
    )  # fmt: skip
    assert sl.returncode == 0, sl.stderr[-3000:]
    summary = json.loads(sl.stdout)
    assert summary["state_path"].startswith("tinker://")
    assert len((home / "sl" / "metrics.jsonl").read_text().splitlines()) == 3
    # The SL run's adapter was freed at its exit: with one slot, RL could not start otherwise.
    rl = cli(
        "train", "rl", "--dataset", "arithmetic", "--model", str(tiny_model),
        "--base-url", skyrl_server.base_url, "--log-path", str(home / "rl"),
        "--loss", "importance_sampling", "--batch-size", "2", "--group-size", "2",
        "--max-tokens", "8", "--max-steps", "2", "--json", env=skyrl_env,
    )  # fmt: skip
    assert rl.returncode == 0, rl.stderr[-3000:]
    assert "loss importance_sampling (jax backend)" in rl.stderr  # the guard knew the server
    assert (
        "note: SkyRL jax differs from Tinker's importance_sampling loss: the loss is averaged "
        "over datums, each divided by its weight count (Tinker sums)" in rl.stderr
    )
    rows = [json.loads(line) for line in (home / "rl" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1]
    assert json.loads(rl.stdout)["sampler_path"].startswith("tinker://")


def test_gspo_is_refused_before_any_rollout(skyrl_server, skyrl_env, tiny_model, tmp_path):
    result = cli(
        "train", "rl", "--dataset", "arithmetic", "--model", str(tiny_model),
        "--base-url", skyrl_server.base_url, "--log-path", str(tmp_path / "run"),
        "--loss", "gspo", env=skyrl_env,
    )  # fmt: skip
    assert result.returncode == 1
    assert "the jax backend cannot compute loss 'gspo'; it serves: cross_entropy, " in (
        result.stderr
    )
    assert not (tmp_path / "run").exists()


def test_gspo_is_refused_by_the_probe_when_the_server_is_not_ours(
    skyrl_server, tiny_model, tmp_path
):
    """A SkyRL server rlcli did not start: its backend is unknown, so a one-datum forward with
    the loss asks it (SkyRL's 400 arrives through retrieve_future)."""
    result = cli(
        "train", "rl", "--dataset", "arithmetic", "--model", str(tiny_model),
        "--base-url", skyrl_server.base_url, "--log-path", str(tmp_path / "run"),
        "--loss", "gspo", env={"RLCLI_HOME": str(tmp_path / "elsewhere")},
    )  # fmt: skip
    assert result.returncode == 1
    assert "(unknown backend) refused loss 'gspo'" in result.stderr
    assert "not supported by the JAX backend" in result.stderr
    assert not (tmp_path / "run").exists()


def test_compute_logprobs_is_one_short_and_compat_aligns_it(skyrl_server, tiny_model):
    import tinker

    skyrl_client.accept_unnumbered_samples()  # SkyRL 0.4.0 answers samples the 0.25 way

    service = tinker.ServiceClient(base_url=skyrl_server.base_url, api_key="tml-dummy")
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    tokens = [5, 17, 42, 8, 99]
    values = sampler.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result()
    assert len(values) == len(tokens) - 1  # SkyRL 0.4.0: none for the first token
    aligned = distill.align_prompt_logprobs(values, len(tokens))
    assert aligned[0] is None and aligned[1:] == list(values)


def test_sampling_seed_must_fit_int32(skyrl_server, tiny_model):
    import tinker

    skyrl_client.accept_unnumbered_samples()  # SkyRL 0.4.0 answers samples the 0.25 way

    service = tinker.ServiceClient(base_url=skyrl_server.base_url, api_key="tml-dummy")
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    prompt = tinker.ModelInput.from_ints([5, 17, 42])

    def sample(seed: int):
        params = tinker.SamplingParams(max_tokens=2, seed=seed)
        return sampler.sample(prompt, num_samples=1, sampling_params=params).result()

    with pytest.raises(Exception, match="out of bounds for int32"):
        sample(3192085446)
    assert len(sample(skyrl_client.bounded_seed(3192085446)).sequences[0].tokens) <= 2


def test_serve_stop_leaves_no_process_behind(skyrl_server, skyrl_env):
    members = pids.family(skyrl_server.pid)
    names = " ".join(" ".join(cmdline(p)) for p in members)
    assert "skyrl.tinker.api" in names and "skyrl.tinker.engine" in names  # uv run, both
    result = run_rlcli("serve", "stop", env=skyrl_env)
    assert result.returncode == 0 and "stopped the server" in result.stderr
    assert alive({skyrl_server.pid: skyrl_server.start_ticks, **members}) == []
    assert pids.family(skyrl_server.pid) == {}


def test_serve_stop_after_the_engine_died_leaves_nothing(skyrl_env, tiny_model):
    record = start(skyrl_env, tiny_model)
    members = pids.family(record.pid)
    engine = [
        p for p in members
        if "skyrl.tinker.engine" in cmdline(p) and cmdline(p)[0].endswith(("python", "python3"))
    ]  # fmt: skip
    assert len(engine) == 1, [cmdline(p) for p in members]
    os.kill(engine[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while pids.pid_alive(engine[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    result = run_rlcli("serve", "stop", env=skyrl_env)
    assert result.returncode == 0, result.stderr
    assert alive({record.pid: record.start_ticks, **members}) == []
    assert pids.family(record.pid) == {}

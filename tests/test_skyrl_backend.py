"""The SkyRL backends without starting SkyRL: the commands and configuration ``serve start
--dry-run`` prints (fsdp/megatron across GPUs and nodes, with and without a Ray cluster), the
one-line errors for flags that do not apply and for missing uv, Python or CUDA (before anything
is downloaded), the loss-semantics note, and the compat adaptations that need no SkyRL.
The live jax backend is tests/test_skyrl_jax.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import httpx
import pytest

from conftest import cli
from rlcli.compat import skyrl_client
from rlcli.errors import RlcliError
from rlcli.launch import skyrl
from rlcli.recipes import loss_guard


def dry_run(home, *args, env=None):
    result = cli(
        "serve", "start", "--base-model", "org/model", "--port", "8765", "--dry-run", *args,
        env={"RLCLI_HOME": str(home), skyrl.CACHE_ENV: None, **(env or {})},
    )  # fmt: skip  # CI exports the cache variable; None unsets it for the call
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def argv_value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_dry_run_jax_is_safe_by_default_and_merges_backend_config_last(tmp_path):
    plan = dry_run(tmp_path, "--backend", "jax", "--backend-config", '{"max_lora_rank": 8}')
    command = shlex.split(plan["command"])
    assert command[1:5] == ["run", "--no-project", "--python", plan["environment"] + "/bin/python"]
    assert command[5:7] == ["-m", "skyrl.tinker.api"]
    assert argv_value(command, "--host") == "127.0.0.1"
    assert argv_value(command, "--backend") == "jax"
    assert argv_value(command, "--base-model") == "org/model"
    assert argv_value(command, "--database-url") == f"sqlite:///{tmp_path}/skyrl/tinker.db"
    assert argv_value(command, "--checkpoints-base") == str(tmp_path / "skyrl" / "checkpoints")
    assert json.loads(argv_value(command, "--backend-config")) == {"max_lora_rank": 8}
    assert plan["environment"].startswith(str(tmp_path / "backends" / "skyrl-0.4.0-jax"))
    assert plan["install_commands"][1].endswith("'skyrl[jax,tinker]==0.4.0' aiohttp")
    assert plan["ray"] == "not used" and "RAY_ADDRESS" not in plan["env"]
    assert not (tmp_path / "backends").exists()  # a dry run installs nothing


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_dry_run_multi_gpu_multi_node_with_a_local_ray(tmp_path, backend):
    plan = dry_run(
        tmp_path, "--backend", backend, "--gpus", "8", "--nodes", "2", "--tp", "4",
        "--max-model-len", "8192",
        "--backend-config", '{"generator.inference_engine.gpu_memory_utilization": 0.7, '
        '"trainer.placement.ref_num_nodes": 1}',
    )  # fmt: skip
    config = json.loads(argv_value(shlex.split(plan["command"]), "--backend-config"))
    assert config == plan["backend_config"]
    expected = {
        "trainer.placement.policy_num_gpus_per_node": 8,
        "trainer.placement.policy_num_nodes": 2,
        "trainer.placement.ref_num_gpus_per_node": 8,
        "trainer.placement.ref_num_nodes": 1,  # --backend-config wins
        "generator.inference_engine.num_engines": 4,  # 16 GPUs / tp 4
        "generator.inference_engine.tensor_parallel_size": 4,
        "generator.inference_engine.engine_init_kwargs.max_model_len": 8192,
        "generator.inference_engine.gpu_memory_utilization": 0.7,
    }
    if backend == "megatron":
        expected["trainer.policy.megatron_config.tensor_model_parallel_size"] = 4
    assert config == expected
    assert plan["skyrl"] == f"skyrl[{backend},tinker]==0.4.0"
    assert "local Ray" in plan["ray"] and "RAY_ADDRESS" not in plan["env"]
    if not skyrl.cuda_present():
        assert "no CUDA here" in plan["note"]


def test_dry_run_with_ray_address_joins_that_cluster(tmp_path):
    plan = dry_run(
        tmp_path, "--backend", "fsdp", "--gpus", "4", "--nodes", "4", "--ray-address",
        "10.0.0.1:6379",
    )  # fmt: skip
    assert plan["env"]["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert plan["ray"] == "joins the cluster at 10.0.0.1:6379"
    assert plan["backend_config"]["generator.inference_engine.num_engines"] == 16


def test_cache_env_var_moves_the_environments(tmp_path):
    plan = dry_run(tmp_path / "home", "--backend", "jax", env={skyrl.CACHE_ENV: str(tmp_path)})
    assert plan["environment"] == str(tmp_path / "skyrl-0.4.0-jax")
    assert plan["env"]["UV_CACHE_DIR"] == str(tmp_path / "uv-cache")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "jax", "--gpus", "2"], "--gpus: not used by --backend jax"),
        (["--backend", "jax", "--tp", "2"], "--tp: not used by --backend jax"),
        (["--backend", "jax", "--nodes", "2"], "--nodes: not used by --backend jax"),
        (["--backend", "fsdp", "--gpus", "3", "--tp", "2"], "--tp 2: the 3 GPUs"),
        (["--backend", "fsdp", "--gpus", "0"], "--gpus 0: must be at least 1"),
        (["--backend", "jax", "--backend-config", "[1]"], "--backend-config: expected a JSON"),
        (["--backend", "jax", "--device", "cuda"], "--device: only for --backend torch"),
        (["--backend", "torch", "--gpus", "2"], "--gpus: only for the SkyRL backends"),
    ],
)
def test_flags_that_do_not_apply_are_one_line_errors(tmp_path, args, message):
    result = cli(
        "serve", "start", "--base-model", "org/model", "--dry-run", *args,
        env={"RLCLI_HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 1
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(skyrl.cuda_present(), reason="this machine has CUDA")
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_no_cuda_is_refused_before_any_download(tmp_path, backend):
    result = cli(
        "serve", "start", "--base-model", "org/model", "--backend", backend, "--gpus", "2",
        env={"RLCLI_HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 1
    assert f"--backend {backend} needs NVIDIA GPUs with the CUDA driver" in result.stderr
    assert "install the NVIDIA driver" in result.stderr
    assert not (tmp_path / "backends").exists() and not (tmp_path / "server.json").exists()


def test_no_suitable_python_says_what_to_install(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYENV_ROOT"}
    env.update(PATH=str(empty), HOME=str(tmp_path), RLCLI_HOME=str(tmp_path / "home"))
    result = subprocess.run(
        [sys.executable, "-m", "rlcli.cli.main", "serve", "start", "--base-model", "org/model",
         "--backend", "jax"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "SkyRL 0.4.0 needs Python 3.12 or newer, and none was found" in result.stderr
    assert "pyenv install 3.12" in result.stderr
    assert not (tmp_path / "home" / "backends").exists()


def test_no_uv_says_what_to_install(tmp_path):
    with pytest.raises(RlcliError, match=r"need uv, which was not found.*pip install 'uv>=0.5'"):
        skyrl.find_uv([str(tmp_path)])
    # rlcli depends on uv, so the default search finds it beside this Python
    assert os.access(skyrl.find_uv(), os.X_OK)


def test_skyrl_note_names_the_differences_that_apply():
    jax = loss_guard.skyrl_note("jax", "importance_sampling", None)
    assert jax == (
        "note: SkyRL jax differs from Tinker's importance_sampling loss: the loss is averaged "
        "over datums, each divided by its weight count (Tinker sums)"
    )
    assert "cispo's default clip is 0.8/1.2 (Tinker: 0/4)" in loss_guard.skyrl_note(
        "jax", "cispo", {}
    )
    assert "default clip" not in loss_guard.skyrl_note("jax", "cispo", {"clip_low_threshold": 0.5})
    fsdp = loss_guard.skyrl_note("fsdp", "gspo", None)
    assert "averaged over datums" not in fsdp
    assert "prompt included" in fsdp and "ignores sequence_ratio_mask" in fsdp
    assert "gspo's default clip is 0.8/1.2" in fsdp
    assert "explicit cispo clip thresholds are refused" in loss_guard.skyrl_note(
        "megatron", "cispo", {"clip_high_threshold": 3.0}
    )
    assert loss_guard.skyrl_note("fsdp", "ppo", None) is None
    assert loss_guard.skyrl_note("torch", "cispo", None) is None
    assert loss_guard.skyrl_note("unknown", "cispo", None) is None


def test_bounded_seed_fits_int32():
    assert skyrl_client.bounded_seed(3192085446) < 2**31  # the seed SkyRL's jax sampler refused
    assert skyrl_client.bounded_seed(12345) == 12345


CREATE_CLIENT = """
import sys, tinker
from rlcli.compat import skyrl_client
if sys.argv[3] == "release":
    skyrl_client.release_adapters_at_exit()
service = tinker.ServiceClient(base_url=sys.argv[1], api_key="tml-dummy")
print(service.create_lora_training_client(base_model=sys.argv[2], rank=1).result().model_id)
"""


def test_training_clients_are_unloaded_when_the_process_exits(server):
    """SkyRL holds a client's LoRA slot until its session times out; compat frees it at exit
    (checked on our server here, which serves the same route; live on SkyRL in
    test_skyrl_jax.py)."""

    def made(mode: str) -> int:
        result = subprocess.run(
            [sys.executable, "-c", CREATE_CLIENT, server.base_url, server.base_model, mode],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        model_id = result.stdout.split()[-1]
        answer = httpx.post(
            f"{server.base_url}/api/v1/get_info", json={"model_id": model_id}, timeout=10
        )
        return answer.status_code

    assert made("keep") == 200  # without the hook the adapter outlives its process
    assert made("release") == 404

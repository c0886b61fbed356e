"""The Docker sandbox and Harbor's verifier against a real Docker daemon (.ci/run starts one
with .ci/docker-up.sh): every example task gives 1 after its solution and 0 with no action; a
broken verifier is 0 and a logged error; no network unless the task asks; memory and CPU
limits hold; a command past its timeout is killed and says so; images are reused by content
hash; no container is left behind."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import uuid
from pathlib import Path

import pytest

from rlcli.errors import RlcliError
from rlcli.harbor import docker, tasks, verifier

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "harbor-tasks"
# How many `sleep 100` processes run in the container (minbase has no pgrep).
LEFT_SLEEPS = (
    "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done | grep -c '^sleep 100'"
)


@pytest.fixture
def run_id(daemon):
    """A fresh run label; afterwards no container of it may be left."""
    run = f"test-{uuid.uuid4().hex[:12]}"
    yield run
    left = docker.run_containers(run)
    docker.remove_containers(left)
    assert left == [], "containers left behind"


def sandbox_of(task, run_id, lifetime=300):
    async def make():
        return await docker.DockerSandboxFactory([task], run_id)(task.environment, lifetime)

    return make()


def test_each_example_task_verifies_1_after_its_solution_and_0_without(run_id):
    async def main():
        results = {}
        for task in tasks.load_tasks(EXAMPLES):
            sandbox = await sandbox_of(task, run_id)
            try:
                before = await verifier.verify(sandbox, task.tests, task.verifier_timeout_s)
                solved = await sandbox.run_command(task.solution.read_text(), workdir="/root")
                assert solved.exit_code == 0, solved.stderr
                after = await verifier.verify(sandbox, task.tests, task.verifier_timeout_s)
            finally:
                await sandbox.cleanup()
            results[task.name] = (before[0], after[0], after[1]["grading_error"])
        return results

    results = asyncio.run(main())
    assert results == {
        "compute-value": (0.0, 1.0, 0.0),
        "fix-script": (0.0, 1.0, 0.0),
        "write-file": (0.0, 1.0, 0.0),
    }


def test_a_broken_verifier_is_reward_0_and_a_logged_error(tmp_path, run_id, caplog):
    task_dir = tmp_path / "broken"
    shutil.copytree(EXAMPLES / "write-file", task_dir)
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho 'oops: no such check' >&2\n"
                                                "exit 3\n")  # fmt: skip
    task = tasks.load_task(task_dir)

    async def main():
        sandbox = await sandbox_of(task, run_id)
        try:
            return await verifier.Verifier(task.tests, sandbox, 30)([])
        finally:
            await sandbox.cleanup()

    with caplog.at_level(logging.ERROR, logger="rlcli.harbor"):
        reward, metrics = asyncio.run(main())
    assert reward == 0.0 and metrics["grading_error"] == 1.0
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "task broken" in errors[0]
    assert "test.sh exited 3 and wrote no /logs/verifier/reward.txt" in errors[0]
    assert "oops: no such check" in errors[0]


def test_isolation_network_memory_cpu_and_timeouts(tmp_path, run_id):
    task_dir = tmp_path / "limits"
    shutil.copytree(EXAMPLES / "write-file", task_dir)
    toml = (task_dir / "task.toml").read_text().replace("memory_mb = 256", "memory_mb = 64")
    (task_dir / "task.toml").write_text(toml.replace("cpus = 1", "cpus = 0.5"))
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/bash\n[ -f /app/big.done ] && echo 1 > /logs/verifier/reward.txt"
        " || echo 0 > /logs/verifier/reward.txt\n"
    )
    task = tasks.load_task(task_dir)

    async def main():
        sandbox = await sandbox_of(task, run_id)
        out = {}
        try:
            # No network: only the loopback interface, no route, no resolver answer.
            out["net"] = await sandbox.run_command(
                "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '; "
                "cat /proc/net/route | tail -n +2 | wc -l; "
                "exec 3<>/dev/tcp/1.1.1.1/80 && echo connected",
                timeout=20,
            )
            # 200 MB in a 64 MB container: killed (137), the container lives on.
            out["hog"] = await sandbox.run_command(
                "a=$(head -c 200000000 /dev/zero | tr '\\0' a) && touch /app/big.done",
                timeout=60,
            )
            out["reward"] = await verifier.verify(sandbox, task.tests, 30)
            out["alive"] = await sandbox.run_command("echo still here", timeout=20)
            out["cgroup"] = await sandbox.run_command(
                "cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/cpu.max 2>/dev/null || "
                "{ cat /sys/fs/cgroup/memory/memory.limit_in_bytes; "
                "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.cfs_period_us; }",
                timeout=20,
            )
            # Past --command-timeout: killed (with its children), reported as a timeout.
            out["slow"] = await sandbox.run_command(
                "sleep 100 & echo started; sleep 100; echo never", timeout=2
            )
            out["after"] = await sandbox.run_command(LEFT_SLEEPS, timeout=20)
            out["cap"] = await sandbox.run_command("yes | head -c 100000", max_output_bytes=1000)
        finally:
            await sandbox.cleanup()
        return out

    out = asyncio.run(main())
    net = out["net"]
    assert net.stdout.split()[:2] == ["lo", "0"], net.stdout
    assert "connected" not in net.stdout and net.exit_code != 0
    assert out["hog"].exit_code == 137
    assert out["reward"][0] == 0.0 and out["reward"][1]["grading_error"] == 0.0
    assert out["alive"].stdout == "still here\n"
    limits = out["cgroup"].stdout.split()
    assert limits[0] == str(64 * 1024 * 1024), limits
    assert int(limits[1]) / int(limits[2]) == 0.5, limits  # quota / period: half a CPU
    slow = out["slow"]
    assert slow.exit_code == docker.TIMEOUT_EXIT and slow.stdout == "started\n"
    assert "command timed out after 2s and was killed" in slow.stderr
    assert out["after"].stdout.strip() == "0"  # the background sleep went too
    assert len(out["cap"].stdout) == 1000 and "output cut at 1000 bytes" in out["cap"].stderr


def test_internet_when_the_task_allows_it(tmp_path, run_id):
    task_dir = tmp_path / "online"
    shutil.copytree(EXAMPLES / "write-file", task_dir)
    toml = (task_dir / "task.toml").read_text()
    (task_dir / "task.toml").write_text(
        toml.replace("allow_internet = false", "allow_internet = true")
    )
    task = tasks.load_task(task_dir)

    async def main():
        sandbox = await sandbox_of(task, run_id)
        try:
            return await sandbox.run_command(
                "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '", timeout=20
            )
        finally:
            await sandbox.cleanup()

    assert "eth0" in asyncio.run(main()).stdout.split()  # the bridge network, not just lo


def test_images_are_tagged_by_content_and_rebuilt_when_the_environment_changes(tmp_path, daemon):
    task_dir = tmp_path / "hashing"
    shutil.copytree(EXAMPLES / "write-file", task_dir)
    task = tasks.load_task(task_dir)
    first, _ = docker.ensure_image(task)
    again, built = docker.ensure_image(task)
    assert again == first and built is False
    dockerfile = task_dir / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "RUN echo v2 > /etc/rlcli-v2\n")
    second, built = docker.ensure_image(task)
    assert second != first and built is True
    assert second.startswith("rlcli-harbor/hashing:")
    docker.docker("rmi", first, second, check=False)


def test_a_broken_dockerfile_names_the_task(tmp_path, daemon):
    task_dir = tmp_path / "unbuildable"
    shutil.copytree(EXAMPLES / "write-file", task_dir)
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM rlcli-harbor-base:bookworm\nRUN exit 7\n"
    )
    with pytest.raises(RlcliError, match=rf"task {task_dir}: docker build of environment/ failed"):
        docker.ensure_image(tasks.load_task(task_dir))


def test_a_missing_daemon_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(RlcliError) as caught:
        docker.check_daemon()
    message = str(caught.value)
    assert message.startswith(
        "--sandbox docker: no Docker daemon answers at unix:///nonexistent/docker.sock"
    )
    assert "DOCKER_HOST" in message and "\n" not in message


def test_a_cookbook_episode_runs_the_models_bash_calls_in_the_container_and_grades_them(
    run_id, tiny_model, monkeypatch
):
    """The cookbook's harbor_rl episode (its env, bash tool, turn handling) with rlcli's
    sandbox and verifier plugged in, driven by assistant turns written as the model would
    write them (a random tiny model never emits a well-formed tool call)."""
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from rlcli.compat import harbor_hooks

    harbor_env = harbor_hooks.import_harbor_env()
    monkeypatch.setattr(harbor_env, "HarborReward", harbor_env.HarborReward)  # restored after
    monkeypatch.setattr(harbor_env, "get_renderer", harbor_env.get_renderer)
    harbor_hooks.install_harbor_hooks()
    tokenizer = get_tokenizer(str(tiny_model))
    spec = tasks.load_task(EXAMPLES / "write-file")
    task = harbor_env.HarborTask(spec.name, spec.instruction, spec.folder, spec.config)

    def turn(text: str) -> list[int]:
        return tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)

    def call(command: str) -> list[int]:
        payload = {"name": "bash", "arguments": {"command": command}}
        return turn(f"<tool_call>\n{json.dumps(payload)}\n</tool_call>")

    async def episode(actions: list[list[int]]):
        builder = harbor_env.HarborDatasetBuilder(
            tasks=[task], batch_size=1, group_size=1, model_name=str(tiny_model),
            renderer_name="qwen3_instruct", max_turns=3, command_timeout=2,
            sandbox_factory=docker.DockerSandboxFactory([spec], run_id),
        )  # fmt: skip
        train, _ = await builder()
        group = train.get_batch(0)[0]
        (env,) = await group.make_envs()
        try:
            observation, _ = await env.initial_observation()
            steps = [await env.step(action) for action in actions]
        finally:
            await group.cleanup()
        return tokenizer.decode(observation.to_ints()), steps

    prompt, steps = asyncio.run(
        episode(
            [
                call("printf 'hello, harbor\\n' > /app/greeting.txt; echo wrote it"),
                call("sleep 30"),
                turn("Done."),
            ]
        )
    )
    assert spec.instruction.strip() in prompt and '"name": "bash"' in prompt
    first, slow, last = steps
    seen = tokenizer.decode(first.next_observation.to_ints())
    assert not first.episode_done and '"exit_code": 0' in seen and "wrote it" in seen
    seen = tokenizer.decode(slow.next_observation.to_ints())
    assert '"exit_code": 124' in seen and "command timed out after 2s and was killed" in seen
    assert last.episode_done and last.reward == 1.0  # the verifier ran in the same container

    _, (only,) = asyncio.run(episode([turn("I will not do anything.")]))
    assert only.episode_done and only.reward == 0.0


def test_a_prebuilt_image_is_used_when_the_daemon_has_it_else_the_dockerfile(tmp_path, daemon):
    task_dir = tmp_path / "prebuilt"
    shutil.copytree(EXAMPLES / "write-file", task_dir)
    toml = task_dir / "task.toml"
    base = toml.read_text()
    toml.write_text(base.replace("[environment]", '[environment]\ndocker_image = "nope/gone:1"'))
    # Not on this daemon (and no registry): the task's Dockerfile is built instead.
    tag, _ = docker.ensure_image(tasks.load_task(task_dir))
    assert tag.startswith("rlcli-harbor/prebuilt:")
    (task_dir / "environment" / "Dockerfile").unlink()
    with pytest.raises(RlcliError, match=r"image nope/gone:1 \(task.toml docker_image\) is not"):
        docker.ensure_image(tasks.load_task(task_dir))
    toml.write_text(
        base.replace("[environment]", '[environment]\ndocker_image = "rlcli-harbor-base:bookworm"')
    )
    assert docker.ensure_image(tasks.load_task(task_dir)) == ("rlcli-harbor-base:bookworm", False)

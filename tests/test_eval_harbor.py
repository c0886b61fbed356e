"""`rlcli eval rl --env <Harbor tasks>` against a real Docker daemon (.ci/run starts one with
.ci/docker-up.sh) and the session's real server: --json has one row per example task, the same
seed gives the same transcripts and rewards, and no container is left; the episode function
`eval rl` runs grades like the verifier (1 after a task's solution, sent as the model's bash
tool call, and 0 for a turn that does nothing); Ctrl-C or SIGTERM mid-episode leaves no
container; a missing daemon is one line.

The tiny model writes no well-formed tool call, so its episodes score the cookbook's failure
reward; the grading test writes the assistant turns by hand instead, as a model would.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import RLCLI, cli
from rlcli.harbor import docker

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "harbor-tasks"
NAMES = ["compute-value", "fix-script", "write-file"]


def eval_containers() -> list[str]:
    """Containers of any `eval rl` episode block (their run label starts with ``eval-``)."""
    done = docker.docker("ps", "-a", "--format", '{{.Label "rlcli.harbor.run"}}', check=False)
    return [run for run in done.stdout.decode().split() if run.startswith("eval-")]


def test_eval_rl_scores_each_task_by_an_episode_stable_for_a_seed(daemon, server, tiny_model):
    args = (
        "eval", "rl", "--env", str(EXAMPLES), "--model", str(tiny_model), "--base-url",
        server.base_url, "--max-new-tokens", "12", "--max-turns", "2", "--temperature", "1",
        "--seed", "7", "--json",
    )  # fmt: skip
    first, again = cli(*args), cli(*args)  # in this process; the Ctrl-C test runs one
    assert first.returncode == 0, first.stderr[-3000:]
    a, b = json.loads(first.stdout), json.loads(again.stdout)
    rows = a["per_task"]
    assert [t["id"] for t in rows] == NAMES and a["tasks"] == 3
    assert set(rows[0]) == {
        "id", "prompt", "response", "reward", "passed", "tokens", "turns", "prompt_tokens",
        "adapter",
    }  # fmt: skip
    instruction = (EXAMPLES / "write-file" / "instruction.md").read_text()
    assert rows[2]["prompt"] == instruction
    assert all(t["response"].startswith("[turn 1] ") and 1 <= t["turns"] <= 2 for t in rows)
    assert all(0 < t["tokens"] <= 12 * t["turns"] for t in rows)
    # no valid tool call from the tiny model: the cookbook's failure reward, nothing passes
    assert all(t["reward"] <= 0 and not t["passed"] for t in rows), rows
    assert a["tokens_generated"] == sum(t["tokens"] for t in rows)
    assert (a["max_turns"], a["command_timeout"], a["env_timeout"]) == (2, 120, 3600)
    assert "task images ready" in first.stderr and "scoring base: 3/3 tasks" in first.stderr
    keep = ("id", "response", "reward", "tokens", "turns")
    assert [[t[k] for k in keep] for t in rows] == [[t[k] for k in keep] for t in b["per_task"]]
    assert eval_containers() == []
    # --task-filter and --tasks pick tasks by name
    one = cli(*args[:-1], "--task-filter", "fix-*,write-file", "--tasks", "1", "--json")
    assert one.returncode == 0, one.stderr[-3000:]
    assert [t["id"] for t in json.loads(one.stdout)["per_task"]] == ["fix-script"]


def test_the_eval_episode_grades_like_the_verifier(daemon, tiny_model):
    """`eval rl`'s own episode function (``HarborTasks.episodes``) driven by a scripted policy:
    the task's solution as a bash tool call, then "Done." is reward 1; doing nothing is 0."""
    from tinker_cookbook.completers import TokenCompleter, TokensWithLogprobs
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from rlcli import envs

    tokenizer = get_tokenizer(str(tiny_model))

    def turn(text: str) -> list[int]:
        return tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)

    def call(command: str) -> list[int]:
        payload = {"name": "bash", "arguments": {"command": command}}
        return turn(f"<tool_call>\n{json.dumps(payload)}\n</tool_call>")

    class Scripted(TokenCompleter):
        def __init__(self, turns: list[list[int]]) -> None:
            self.turns = list(turns)

        async def __call__(self, model_input, stop, *, max_tokens=None):
            tokens = self.turns.pop(0)
            return TokensWithLogprobs(tokens, [0.0] * len(tokens))

    env = envs.get(str(EXAMPLES), harbor=True)
    assert env.multi_turn and [r["id"] for r in env.problems("test", 0)] == NAMES
    env.prepare(lambda line: None)
    solutions = {name: (EXAMPLES / name / "solution" / "solve.sh").read_text() for name in NAMES}

    async def main(play):
        solved = [play({"id": n}, Scripted([call(solutions[n]), turn("Done.")])) for n in NAMES]
        idle = [play({"id": n}, Scripted([turn("I will not do anything.")])) for n in NAMES]
        return await asyncio.gather(*solved, *idle)

    with env.episodes(
        str(tiny_model), "qwen3_instruct", max_turns=3, command_timeout=30, env_timeout=300,
        max_tokens=4096,
    ) as play:  # fmt: skip
        episodes = asyncio.run(main(play))
    assert [e.reward for e in episodes] == [1.0] * 3 + [0.0] * 3
    assert [e.turns for e in episodes] == [2] * 3 + [1] * 3
    assert (
        "[turn 1] <tool_call>" in episodes[0].response and "[turn 2] Done." in episodes[0].response
    )
    assert eval_containers() == []


def test_a_missing_daemon_is_one_line_before_any_sampling(server, tiny_model):
    dead = "unix:///nonexistent/docker.sock"
    result = cli(
        "eval", "rl", "--env", str(EXAMPLES), "--model", str(tiny_model), "--base-url",
        server.base_url, env={"DOCKER_HOST": dead},
    )  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --env {EXAMPLES}: no Docker daemon answers at {dead}"), last
    assert "scoring" not in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_mid_episode_removes_every_container(daemon, server, tiny_model, sig):
    """Stopped while its episodes run (3000-token turns keep them going), `eval rl` exits 130
    (Ctrl-C) or 143 (SIGTERM) and leaves no container."""
    process = subprocess.Popen(
        [*RLCLI, "eval", "rl", "--env", str(EXAMPLES), "--model", str(tiny_model),
         "--base-url", server.base_url, "--max-new-tokens", "3000", "--max-turns", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for _ in range(600):  # until its containers are up (the episodes have begun)
            if eval_containers() or process.poll() is not None:
                break
            time.sleep(0.1)
        assert eval_containers(), "no episode container appeared"
        process.send_signal(sig)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == (130 if sig == signal.SIGINT else 143), err[-3000:]
    assert "Traceback" not in err and "never retrieved" not in err, err[-3000:]
    assert eval_containers() == []

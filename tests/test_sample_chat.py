"""`rlcli sample` and `rlcli chat` against a real server: a checkpoint taught one answer
("zebra zebra zebra") says it, the base model does not; --raw skips the chat template; -n
gives that many; the prompt can come from stdin; a chat driven through a pty answers from the
checkpoint, /reset and Ctrl-D work; a training state, a missing checkpoint and a dead server
are one line each."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from conftest import RLCLI, cli, run_rlcli, train_zebra


@pytest.fixture(scope="module")
def zebra(server, tiny_model):
    return train_zebra(server.base_url, str(tiny_model))


def test_sample_answers_from_the_checkpoint_not_the_base_model(server, tiny_model, zebra):
    from tinker_cookbook import renderers

    from rlcli.compat.renderer_choice import resolve_renderer

    url = ["--base-url", server.base_url]
    greedy = ["--prompt", "Hello there", "--temperature", "0", "--max-tokens", "12"]
    out = run_rlcli("sample", "--checkpoint", zebra["sampler"], *greedy, "-n", "3", "--json", *url)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["checkpoint"] == zebra["sampler"]
    assert result["model"] == str(tiny_model)  # asked from the server
    assert len(result["samples"]) == 3
    assert all(s["text"].startswith("zebra zebra") for s in result["samples"]), result
    name, _, tokenizer = resolve_renderer(str(tiny_model), None)
    rendered = renderers.get_renderer(name, tokenizer).build_generation_prompt(
        [{"role": "user", "content": "Hello there"}]
    )
    assert result["prompt_tokens"] == rendered.length  # the chat template was applied
    assert {s["tokens"] for s in result["samples"]} == {12}
    assert {s["stop_reason"] for s in result["samples"]} == {"length"}

    base = cli("sample", "--model", str(tiny_model), *greedy, *url)
    assert base.returncode == 0, base.stderr
    assert base.stdout.strip() and "zebra" not in base.stdout

    raw = cli(
        "sample", "-c", zebra["sampler"], "--raw", "-p", "-", "--max-tokens", "5",
        "--seed", "1", "-n", "2", "--json", *url, stdin="Hello there\n",
    )  # fmt: skip
    assert raw.returncode == 0, raw.stderr
    raw_result = json.loads(raw.stdout)
    assert raw_result["renderer"] is None
    assert raw_result["prompt_tokens"] == len(tokenizer.encode("Hello there"))
    assert len(raw_result["samples"]) == 2


def test_sample_refuses_what_it_cannot_sample_in_one_line(server, tiny_model, zebra):
    url = ["--base-url", server.base_url]
    state = cli("sample", "-c", zebra["state"], "-p", "hi", *url)
    assert state.returncode == 1
    (line,) = state.stderr.strip().splitlines()[-1:]
    assert "training state" in line and zebra["sampler"] in line  # names the samplable path
    missing = zebra["sampler"].replace("/zebra", "/nope")
    gone = cli("sample", "-c", missing, "-p", "hi", *url)
    assert gone.returncode == 1 and "no such checkpoint" in gone.stderr
    other = cli("sample", "--model", "org/other-model", "-p", "hi", *url)
    assert other.returncode == 1 and f"serves {tiny_model}" in other.stderr
    dead = cli("sample", "--model", str(tiny_model), "-p", "hi", "--base-url", "http://127.0.0.1:9")
    assert dead.returncode == 1 and "no Tinker server answered" in dead.stderr
    assert len(dead.stderr.strip().splitlines()) == 1


def test_chat_in_a_terminal_answers_from_the_checkpoint(server, zebra):
    import pexpect

    child = pexpect.spawn(
        RLCLI[0],
        [*RLCLI[1:], "chat", "-c", zebra["sampler"], "--temperature", "0", "--max-tokens", "12",
         "--base-url", server.base_url],
        encoding="utf-8",
        timeout=120,
        env={**os.environ, "TERM": "dumb"},
    )  # fmt: skip
    try:
        answers = []
        child.expect("you> ")
        child.sendline("Hello there")
        child.expect(r"model> (.*)\r\n")
        answers.append(child.match.group(1))
        child.expect("you> ")
        child.sendline("And once more?")  # the second turn is rendered after the first
        child.expect(r"model> (.*)\r\n")
        answers.append(child.match.group(1))
        assert all("zebra" in a for a in answers), answers
        child.expect("you> ")
        child.sendline("/reset")
        child.expect(r"conversation forgotten")
        child.expect("you> ")
        child.sendline("Hello there")  # a fresh conversation: the first answer again
        child.expect(r"model> (.*)\r\n")
        assert child.match.group(1) == answers[0]
        child.expect("you> ")
        child.sendeof()  # Ctrl-D leaves
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_ctrl_c_in_chat_cancels_the_answer_and_keeps_the_session(server, tiny_model):
    import pexpect

    child = pexpect.spawn(
        RLCLI[0],
        [*RLCLI[1:], "chat", "--model", str(tiny_model), "--max-tokens", "3500", "--seed", "0",
         "--base-url", server.base_url],
        encoding="utf-8",
        timeout=120,
    )  # fmt: skip
    try:
        child.expect("you> ")
        child.sendline("Hello there")
        child.expect("model> ")  # the answer streams in: it is being written
        child.sendintr()
        child.expect(r"\(cancelled\)")
        deadline = time.monotonic() + 20  # the server dropped the 3500-token answer's row
        while httpx.get(f"{server.base_url}/rlcli/status").json()["pending_requests"]:
            assert time.monotonic() < deadline, "the cancelled answer kept decoding"
            time.sleep(0.05)
        child.expect("you> ")  # still in the conversation
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0

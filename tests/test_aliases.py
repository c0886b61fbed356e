"""Aliases (``rlcli alias``, ``server/state/aliases.py``) on a tiny-model server of this
module's own (it is restarted at the end): set, list, history, rollback through the CLI; the
alias as a model at ``/v1`` (the ``openai`` client) and for ``sample``; an atomic switch under
concurrent streams (every stream is wholly the old or the new checkpoint's); the refusals,
each one line with the table unchanged; the table after a server restart."""

from __future__ import annotations

import json
import shutil
import threading

import openai
import pytest

from conftest import ANSWER, cli, start_server, train_zebra

HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("alias-home")


@pytest.fixture(scope="module")
def served(home, tiny_model):
    from rlcli.launch import process

    record = start_server(home, tiny_model)
    yield record
    process.stop(home)


@pytest.fixture(scope="module")
def zebra(served, tiny_model):
    return train_zebra(served.base_url, str(tiny_model), "alias-zebra")


def alias(served, *args):
    return cli("alias", *args, "--base-url", served.base_url)


def client(record):
    return openai.OpenAI(base_url=f"{record.base_url}/v1", api_key="tml-dummy", max_retries=0)


def test_set_list_history_rollback_and_v1(served, zebra, tiny_model):
    first = alias(served, "set", "prod", str(tiny_model), "--why", "start", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["current"] == 1
    second = alias(served, "set", "prod", zebra["sampler"], "--why", "taught zebra", "--json")
    assert second.returncode == 0, second.stderr
    shown = json.loads(second.stdout)
    assert (shown["current"], shown["checkpoint"], shown["state"]) == (
        2, zebra["sampler"], zebra["state"]  # the training state found beside it
    )  # fmt: skip
    models = {m.id: m for m in client(served).models.list().data}
    assert models["prod"].parent == zebra["sampler"]
    raw = client(served).chat.completions.with_raw_response.create(
        model="prod", messages=HELLO, max_tokens=40, temperature=0
    )
    assert raw.headers["x-rlcli-checkpoint"] == zebra["sampler"]
    assert raw.parse().choices[0].message.content.startswith(ANSWER)
    greedy = ["--temperature", "0", "--max-tokens", "40", "--prompt", "Hello there"]
    sampled = cli("sample", "--checkpoint", "prod", "--base-url", served.base_url, *greedy)
    assert sampled.returncode == 0, sampled.stderr
    assert ANSWER in sampled.stdout

    back = alias(served, "rollback", "prod", "--why", "bad answers", "--json")
    assert json.loads(back.stdout)["current"] == 1
    history = json.loads(alias(served, "history", "prod", "--json").stdout)
    assert [(e["action"], e["version"], e["from"], e["why"]) for e in history["log"]] == [
        ("set", 1, None, "start"), ("set", 2, 1, "taught zebra"), ("rollback", 1, 2, "bad answers"),
    ]  # fmt: skip
    assert all("alias" in e["by"] and "@" in e["by"] for e in history["log"])
    listed = alias(served, "list")
    assert "prod" in listed.stdout and "1/2" in listed.stdout
    forward = alias(served, "rollback", "prod", "--to", "2", "--json")
    assert json.loads(forward.stdout)["checkpoint"] == zebra["sampler"]


def test_refusals_are_one_line_and_change_nothing(served, zebra, home, tiny_model):
    alias(served, "set", "solo", str(tiny_model))
    before = (home / "checkpoints" / "aliases.json").read_text()
    # A checkpoint of another base model: a copy of the zebra run as a server of another
    # model sharing this checkpoints folder would have written it.
    root = home / "checkpoints"
    shutil.copytree(root / zebra["run_id"], root / "other-run", symlinks=True)
    run = json.loads((root / "other-run" / "run.json").read_text())
    (root / "other-run" / "run.json").write_text(json.dumps({**run, "base_model": "org/other"}))
    name = zebra["sampler"].rsplit("/", 1)[1]
    cases = [
        (("set", "solo", f"tinker://other-run/sampler_weights/{name}"), "is a checkpoint of"),
        (("rollback", "solo"), "version 1 is its first"),
        (("rollback", "solo", "--to", "3"), "has versions 1 to 1"),
        (("set", "solo", zebra["state"]), "is a training state"),
        (("set", "solo", "tinker://nope/sampler_weights/x"), "no checkpoint at"),
        (("set", "solo", "gpt2"), "neither a tinker:// checkpoint nor the base model"),
        (("set", "a/b", str(tiny_model)), "not a valid alias name"),
        (("history", "nobody"), "no alias 'nobody'"),
    ]
    for args, expected in cases:
        result = alias(served, *args)
        assert result.returncode == 1, args
        assert result.stderr.count("\n") == 1 and expected in result.stderr, (args, result.stderr)
    assert (home / "checkpoints" / "aliases.json").read_text() == before
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client(served).chat.completions.create(model="nobody", messages=HELLO, max_tokens=2)


def test_a_switch_under_concurrent_streams_never_mixes_checkpoints(served, zebra, tiny_model):
    """Two waves of 8 streams of 16 tokens (EOS ignored): the first starts on the base model,
    the alias switches to the zebra LoRA while those streams are open (first chunk read, the
    rest not), the second wave starts, the alias switches back; then all are read to the end.
    Each stream is exactly its own checkpoint's greedy answer, the one its header names."""
    kwargs = dict(messages=HELLO, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    ai = client(served)
    reference = {
        str(tiny_model): ai.chat.completions.create(model=str(tiny_model), **kwargs),
        zebra["sampler"]: ai.chat.completions.create(model=zebra["sampler"], **kwargs),
    }
    reference = {k: v.choices[0].message.content for k, v in reference.items()}
    assert len(set(reference.values())) == 2
    alias(served, "set", "flip", str(tiny_model))
    seen, errors, release = [], [], threading.Event()

    def stream(started: threading.Semaphore):
        try:
            raw = ai.chat.completions.with_raw_response.create(model="flip", stream=True, **kwargs)
            chunks = iter(raw.parse())
            text = [next(chunks).choices[0].delta.content or ""]
            started.release()
            release.wait()
            text += [c.choices[0].delta.content or "" for c in chunks if c.choices]
            seen.append((raw.headers["x-rlcli-checkpoint"], "".join(text)))
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)
            started.release()

    threads = []
    for target in (zebra["sampler"], str(tiny_model)):
        started = threading.Semaphore(0)
        wave = [threading.Thread(target=stream, args=(started,)) for _ in range(8)]
        for t in wave:
            t.start()
        for _ in wave:
            started.acquire()  # every stream of the wave is open
        assert alias(served, "set", "flip", target).returncode == 0
        threads += wave
    release.set()
    for t in threads:
        t.join()
    assert not errors, errors
    served_by = [checkpoint for checkpoint, _ in seen]
    assert sorted(served_by) == sorted([str(tiny_model)] * 8 + [zebra["sampler"]] * 8)
    for checkpoint, text in seen:
        assert text == reference[checkpoint]


def test_aliases_survive_a_restart(home, served, zebra, tiny_model):
    from rlcli.launch import process

    alias(served, "set", "kept", zebra["sampler"], "--why", "before restart")
    before = json.loads(alias(served, "history", "kept", "--json").stdout)
    process.stop(home)
    record = start_server(home, tiny_model)
    after = json.loads(alias(record, "history", "kept", "--json").stdout)
    assert after == before
    answer = client(record).chat.completions.create(
        model="kept", messages=HELLO, max_tokens=40, temperature=0
    )
    assert answer.choices[0].message.content.startswith(ANSWER)

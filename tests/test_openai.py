"""The OpenAI-compatible endpoint (``/v1``) through real clients on the shared tiny-model
server: the official ``openai`` package (chat and completions, streaming and not, n > 1,
logprobs), a disconnect mid-stream, ``curl -N`` for the raw SSE framing, a LoRA checkpoint
answering as ``rlcli sample --checkpoint`` does, and bad input answered 400 in OpenAI's shape.
The API key (Bearer and X-API-Key) is in test_endpoint.py, on its keyed server."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ANSWER, cli, train_zebra


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="tml-dummy", max_retries=0)


@pytest.fixture(scope="module")
def zebra(server, tiny_model):
    return train_zebra(server.base_url, str(tiny_model))


HELLO = [{"role": "user", "content": "Hello there"}]


def _streamed(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons per choice index, and the chunks, from an openai stream."""
    texts, reasons, chunks = {}, {}, []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_chat_streaming_gives_the_same_choices_as_the_whole_answer(client, tiny_model):
    kwargs = dict(model=str(tiny_model), messages=HELLO, n=3, max_tokens=12, seed=7)
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) > 1  # n rows, each its own draw
    assert all(c.finish_reason in ("stop", "length") for c in whole.choices)
    assert whole.usage.prompt_tokens == 14  # the chat template's tokens for one user turn
    texts, reasons, chunks = _streamed(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[0].choices[0].delta.role == "assistant"
    # Token by token: more content chunks than choices, the usage last and complete.
    assert sum(1 for c in chunks if any(x.delta.content for x in c.choices)) > 3
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completions_match_the_tinker_sample_path(client, service, tiny_model):
    """Same prompt tokens and seed: /v1/completions (streamed and not) draws the tokens and
    logprobs the Tinker ``sample`` call draws, and its text is their decoding."""
    from tinker import types
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    prompt = tokenizer.encode("the cat sat on")
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    params = types.SamplingParams(max_tokens=10, temperature=1.0, seed=11)
    tinker = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    kwargs = dict(model=str(tiny_model), prompt=prompt, n=2, max_tokens=10, seed=11)
    whole = client.completions.create(**kwargs, logprobs=3)
    for seq, choice in zip(tinker.sequences, whole.choices, strict=True):
        tokens = [t for t in seq.tokens if t != tokenizer.eos_token_id]  # EOS: not text
        assert choice.text == tokenizer.decode(tokens)
        got = choice.logprobs.token_logprobs
        assert got == pytest.approx(seq.logprobs[: len(got)], abs=1e-4)
        # Three alternatives per token (fewer keys where two tokens decode to one string).
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    texts, _, _ = _streamed(client.completions.create(**kwargs, stream=True))
    assert texts == {c.index: c.text for c in whole.choices}
    # Several prompts: choice index = prompt * n + sample.
    two = client.completions.create(
        model=str(tiny_model), prompt=["a b c", "d e f"], n=2, max_tokens=4, seed=1
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.usage.completion_tokens <= 16


def test_stop_strings_end_the_text_before_them(client, tiny_model):
    free = client.completions.create(
        model=str(tiny_model), prompt="1 2 3", max_tokens=24, temperature=0
    ).choices[0]
    stop = free.text[5:7]  # a string the greedy answer contains
    assert stop.strip()
    cut = client.completions.create(
        model=str(tiny_model), prompt="1 2 3", max_tokens=24, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    texts, reasons, _ = _streamed(
        client.completions.create(
            model=str(tiny_model), prompt="1 2 3", max_tokens=24, temperature=0, stop=[stop],
            stream=True,
        )
    )  # fmt: skip
    assert texts == {0: cut.text} and reasons == {0: "stop"}


def test_ignore_eos_draws_every_token_asked_for(client, tiny_model):
    """vLLM's ``ignore_eos``: each row runs to max_tokens (what load generators rely on)."""
    answer = client.completions.create(
        model=str(tiny_model), prompt=[5, 6], n=4, max_tokens=48, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.finish_reason for c in answer.choices] == ["length"] * 4
    assert answer.usage.completion_tokens == 4 * 48


def test_a_sft_checkpoint_answers_as_rlcli_sample_does(client, server, zebra):
    listed = [m.id for m in client.models.list().data]
    assert zebra["sampler"] in listed
    answer = client.chat.completions.create(
        model=zebra["sampler"], messages=HELLO, temperature=0, max_tokens=40
    )
    text = answer.choices[0].message.content
    sampled = cli(
        "sample", "-c", zebra["sampler"], "-p", "Hello there", "--temperature", "0",
        "--max-tokens", "40", "--json", "--base-url", server.base_url,
    )  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    assert text == json.loads(sampled.stdout)["samples"][0]["text"]
    assert text.startswith(ANSWER)  # what it was taught, the same way sample says it
    texts, _, _ = _streamed(
        client.chat.completions.create(
            model=zebra["sampler"], messages=HELLO, temperature=0, max_tokens=40, stream=True
        )
    )
    assert texts == {0: text}


def test_a_client_that_hangs_up_frees_its_row_and_nobody_else_notices(client, server, tiny_model):
    """Two streams decode together; one client leaves after a few tokens: its request is
    answered (cancelled) within a step or two, the other stream finishes whole."""
    body = {
        "model": str(tiny_model), "messages": HELLO, "max_tokens": 3500, "stream": True,
        "stop": ["<never>"], "seed": 3,
    }  # fmt: skip
    other = {}

    def finish_other():
        texts, reasons, _ = _streamed(
            client.chat.completions.create(
                model=str(tiny_model), messages=HELLO, max_tokens=300, seed=5, stream=True
            )
        )
        other.update(texts=texts, reasons=reasons)

    url = f"{server.base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        thread = threading.Thread(target=finish_other)
        thread.start()
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 6:
                break
    left = time.monotonic()
    thread.join(120)
    deadline = left + 30
    while time.monotonic() < deadline:
        status = httpx.get(f"{server.base_url}/rlcli/status", timeout=5).json()
        if status["pending_requests"] == 0:
            break
        time.sleep(0.05)
    assert status["pending_requests"] == 0  # the 3500-token request is gone, not decoding
    assert other["reasons"] == {0: "length"} or other["reasons"] == {0: "stop"}
    alone = client.chat.completions.create(
        model=str(tiny_model), messages=HELLO, max_tokens=300, seed=5
    )
    assert other["texts"] == {0: alone.choices[0].message.content}
    log = Path(server.log_path).read_text()
    assert "client gone; its rows leave the batch" in log


def test_a_tinker_request_joins_a_running_openai_batch(client, service, tiny_model):
    """A short Tinker sample arriving while a long /v1 completion decodes is answered long
    before that completion ends (it joined the running batch instead of waiting for it). The
    long one is /v1's because only /v1 can ignore EOS (vLLM's ``ignore_eos``): a long Tinker
    sample of the random tiny model ends at its first EOS, once in 0.5 s, before the short
    request's answer."""
    from tinker import types

    long = {}

    def decode() -> None:
        long["out"] = client.completions.create(
            model=str(tiny_model), prompt="a b c", max_tokens=3500, temperature=1.0, seed=1,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    thread = threading.Thread(target=decode)
    thread.start()
    time.sleep(0.5)
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    short = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, params).result()
    assert len(short.sequences[0].tokens) >= 1
    assert thread.is_alive()  # still decoding: the Tinker request did not wait for it
    thread.join(timeout=120)
    assert long["out"].usage.completion_tokens == 3500


def test_curl_sees_server_sent_events(server, tiny_model):
    body = json.dumps(
        {"model": str(tiny_model), "prompt": "a b", "max_tokens": 5, "stream": True, "seed": 1}
    )
    out = subprocess.run(
        ["curl", "-sN", "-D", "-", f"{server.base_url}/v1/completions",
         "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, timeout=60, check=True,
    ).stdout.decode()  # fmt: skip
    head, _, events = out.partition("\r\n\r\n")
    assert "content-type: text/event-stream" in head.lower()
    frames = events.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    data = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert all(f.startswith("data: ") for f in frames[:-1])
    assert len(data) >= 5 and all(d["object"] == "text_completion" for d in data)
    assert data[-1]["choices"][0]["finish_reason"] in ("length", "stop")


BAD = [
    ("malformed JSON", b"{not json", None),
    ("messages not a list", {"messages": "hi"}, "messages"),
    ("an unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("max_tokens above the cap", {"max_tokens": 10**6}, "max_tokens"),
    ("n = 0", {"n": 0}, "n"),
    ("n = 1000", {"n": 1000}, "n"),
    ("a prompt over the context", {"messages": [{"role": "user", "content": "x " * 5000}]},
     "messages"),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("response_format json", {"response_format": {"type": "json_object"}}, "response_format"),
    ("an image", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[0].type"),
    ("a temperature of 3", {"temperature": 3}, "temperature"),
]  # fmt: skip


def test_bad_input_is_a_400_in_openai_shape_and_nothing_else_changes(client, server, tiny_model):
    url = f"{server.base_url}/v1/chat/completions"
    base = {"model": str(tiny_model), "messages": HELLO, "max_tokens": 4}
    log_before = Path(server.log_path).read_text().count("\n")
    for what, change, param in BAD:
        if isinstance(change, bytes):
            response = httpx.post(url, content=change, headers={"Content-Type": "application/json"})
        else:
            response = httpx.post(url, json={**base, **change})
        assert response.status_code == 400, (what, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, what
        assert error["type"] == "invalid_request_error" and error["param"] == param, what
        assert "\n" not in error["message"] and (param is None or param in error["message"])
    unknown = httpx.post(url, json={**base, "model": "org/nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    missing = httpx.post(url, json={**base, "model": "tinker://nope/sampler_weights/x"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    route = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert route.status_code == 404 and "error" in route.json()
    lines = Path(server.log_path).read_text().splitlines()[log_before:]
    refusals = [line for line in lines if "/v1/" in line and (" 400 " in line or " 404 " in line)]
    assert len(refusals) >= len(BAD) + 3  # one line each
    ok = client.chat.completions.create(model=str(tiny_model), messages=HELLO, max_tokens=3)
    assert ok.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model=str(tiny_model), messages=HELLO, tools=[{"type": "function",
            "function": {"name": "f", "parameters": {}}}],
        )  # fmt: skip


def test_text_stream_holds_back_partial_stops_and_characters():
    """Tokens here are bytes: what is sent never has to be taken back."""
    from rlcli.server.http.openai.text import TextStream

    def decode(tokens):
        return bytes(tokens).decode("utf-8", errors="replace")

    stream = TextStream(decode, ["STOP"], frozenset({0}))
    sent = [stream.push(b, None)[0] for b in b"ab ST"]
    assert "".join(sent) == "ab "  # "ST" may be the start of STOP: held back
    assert stream.push(ord("x"), None)[0] == "STx"  # it was not
    euro = "€".encode()  # three bytes: nothing until the character is whole
    assert [stream.push(b, None)[0] for b in euro] == ["", "", "€"]
    tail = [stream.push(b, None)[0] for b in b"yySTOPzz"]
    assert "".join(tail) == "yy" and stream.finish_reason == "stop"
    assert stream.text == "ab STx€yy" and stream.drawn == 5 + 1 + 3 + 8
    done = TextStream(decode, [], frozenset({0}))
    assert done.push(ord("a"), None) == ("a", True)
    assert done.push(0, "stop") == ("", False)  # the end-of-turn token is not text
    assert done.text == "a" and done.finish_reason == "stop" and done.drawn == 2

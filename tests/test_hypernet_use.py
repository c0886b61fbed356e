"""Using a doc-to-LoRA hypernetwork beyond `rlcli hypernet internalize` (test_d2l.py): the
`rlcli internalize DOCUMENT --hypernet` route (CLI in process, Python API, session keys, its
refusals) and `rlcli eval rl --env niah` with each haystack internalized (`--hypernet`) or
removed (`--without-context`), on the tiny model and the session's real server.

A fresh hypernetwork is enough here: its adapters are no-ops (test_d2l checks that), so these
tests check the plumbing (which prompt was sent, which adapter, made once per task), not
scores; whether a trained one answers is benchmarks/d2l_learning.py's question.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import cli

DEAD_URL = "http://127.0.0.1:9"
# chunks of 64 tokens, at most 8: a niah haystack of 60 words fits, one of 400 does not
NET = {"rank": 4, "latent": 16, "chunk_tokens": 64, "max_chunks": 8}
FACT = "Kalo's favorite color is red. Kalo lives in a small house by the sea.\n"


@pytest.fixture(scope="module")
def fresh(server):
    """A saved hypernetwork that never trained (its adapters are no-ops)."""
    from rlcli.client.d2l import Hypernets

    hypernets = Hypernets(server.base_url)
    made = hypernets.create(seed=0, **NET)
    path = hypernets.save(made["hypernet_id"], "fresh")["path"]
    hypernets.remove(made["hypernet_id"])
    return path


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    path = tmp_path_factory.mktemp("doc") / "kalo.md"
    path.write_text(FACT)
    return path


@pytest.fixture(scope="module")
def no_hypernets_server():
    """What a Tinker server without rlcli's hypernetwork routes answers (SkyRL's jax backend:
    no health route, capabilities without "hypernetworks"); nothing else is asked of it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/api/v1/get_server_capabilities":
                caps = {"supported_models": [{"model_name": "m"}], "backend": "jax"}
                body, status = json.dumps(caps).encode(), 200
            else:
                body, status = b'{"detail": "Not Found"}', 404
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def one_line(result, where: str) -> None:
    assert result.returncode == 1, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and where in lines[0], result.stderr


def one_error(result, where: str) -> None:
    """One ``error:`` line, the last (eval says which server and renderer before it)."""
    assert result.returncode == 1, result.stdout
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == lines[-1:] and where in lines[-1], result.stderr


# ---- rlcli internalize --hypernet -----------------------------------------------------------


def test_internalize_hypernet_cli_prints_the_adapter_and_a_key_reuses_it(
    server, fresh, document, tiny_model
):
    args = ("internalize", document, "--hypernet", fresh, "--base-url", server.base_url)
    made = cli(*args, "--session-key", "kalo-v1", "--model", tiny_model, "--json")
    assert made.returncode == 0, made.stderr
    summary = json.loads(made.stdout)
    path = summary["sampler_path"]
    assert path.startswith("tinker://") and "/sampler_weights/" in path
    assert summary["document"] == str(document) and summary["hypernet"] == fresh
    assert summary["reused"] is False and summary["chunks"] == 1 and summary["rank"] == 8
    assert summary["expires_at"] is not None  # the default TTL: a day
    again = cli(*args, "--session-key", "kalo-v1", "--json")  # --model is optional
    assert json.loads(again.stdout)["sampler_path"] == path
    assert json.loads(again.stdout)["reused"] is True
    table = cli(*args, "--pin")  # no key: a new adapter, pinned; printed as a table
    assert table.returncode == 0, table.stderr
    assert "sampler_path" in table.stdout and path not in table.stdout
    sampled = cli("sample", "--checkpoint", path, "-p", "What color?", "--max-tokens", "2",
                  "--base-url", server.base_url, "--json")  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr


def test_internalize_hypernet_python_api(server, fresh, document):
    import rlcli
    from rlcli import InternalizeOptions

    options = InternalizeOptions(
        documents=[str(document)], hypernet=fresh, base_url=server.base_url, pin=True
    )
    done = rlcli.internalize(options)
    assert done.summary["sampler_path"].startswith("tinker://") and done.run_dir is None
    assert done.summary["expires_at"] is None  # pinned
    keyed = InternalizeOptions(
        documents=[str(document)], hypernet=fresh, base_url=server.base_url, session_key="api"
    )
    first, second = rlcli.internalize(keyed), rlcli.train(keyed)  # train routes it the same
    assert first.summary["sampler_path"] == second.summary["sampler_path"]
    assert second.summary["reused"] and second.summary["seconds"] is None


def test_internalize_hypernet_refusals_are_one_line(
    server, fresh, document, tmp_path, tiny_model, no_hypernets_server
):
    args = ("internalize", document, "--base-url", DEAD_URL)
    one_line(cli(*args, "--hypernet", fresh, "--epochs", "2"), "--epochs 2 with --hypernet")
    one_line(cli(*args, "--hypernet", fresh, "--teacher", "x"), "--teacher x with --hypernet")
    one_line(cli(*args, "--hypernet", fresh, "--dry-run"), "--dry-run with --hypernet")
    one_line(cli(*args, "--model", tiny_model, "--session-key", "k", "--dry-run"),
             "--session-key: only with --hypernet")  # fmt: skip
    one_line(cli(*args, "--dry-run"), "missing --model")
    adapter = "tinker://run-1/sampler_weights/final"
    one_line(cli(*args, "--hypernet", adapter), "a sampler_weights checkpoint (a LoRA adapter)")
    one_line(cli(*args, "--hypernet", fresh, "--ttl", "60", "--pin"), "--ttl with --pin")
    other = tmp_path / "other.md"
    other.write_text("Another text.")
    two = cli("internalize", document, other, "--hypernet", fresh, "--base-url", DEAD_URL)
    one_line(two, "--hypernet: one document per call, got 2")
    empty = tmp_path / "empty.md"
    empty.write_text(" \n")
    one_line(cli("internalize", empty, "--hypernet", fresh, "--base-url", DEAD_URL), "empty")
    # the server: one without hypernetworks, and a model it does not serve
    nowhere = cli("internalize", document, "--hypernet", fresh, "--base-url", no_hypernets_server)
    one_line(nowhere, "(jax) hosts no hypernetworks")
    wrong = cli("internalize", document, "--hypernet", fresh, "--base-url", server.base_url,
                "--model", "org/other-model")  # fmt: skip
    one_line(wrong, "--model org/other-model: the server at")


# ---- eval rl --env niah ---------------------------------------------------------------------


def test_eval_niah_hypernet_internalizes_each_haystack_once_and_asks_without_it(
    server, fresh, tiny_model
):
    from rlcli import envs
    from rlcli.client.evaluate import EvalOptions, evaluate

    opts = EvalOptions(
        env="niah:words=60", hypernet=fresh, base_url=server.base_url, tasks=3,
        max_new_tokens=4, seed=7,
    )  # fmt: skip
    result = evaluate(opts)  # --model: the server's
    assert result["context"] == "hypernet" and result["hypernet"] == fresh
    assert result["policy"] == "hypernet" and result["tasks"] == 3
    assert result["internalized"]["made"] == 3 and result["internalized"]["reused"] == 0
    rows = envs.get("niah:words=60").problems("test", 7, 3)
    adapters = [t["adapter"] for t in result["per_task"]]
    assert len(set(adapters)) == 3 and all("/sampler_weights/" in a for a in adapters)
    for task, row in zip(result["per_task"], rows, strict=True):
        assert task["prompt"] == row["query"]  # the question alone: no haystack
        assert row["context"] not in task["prompt"] and task["prompt_tokens"] < 60
    # again, compared with the base model: the same adapters, reused (none recomputed)
    again = cli("eval", "rl", "--env", "niah:words=60", "--hypernet", fresh, "--tasks", "3",
                "--seed", "7", "--max-new-tokens", "4", "--base-url", server.base_url,
                "--compare", "--json")  # fmt: skip
    assert again.returncode == 0, again.stderr
    out = json.loads(again.stdout)
    assert out["internalized"]["made"] == 0 and out["internalized"]["reused"] == 3
    assert [t["adapter"] for t in out["checkpoint"]["per_task"]] == adapters
    assert out["checkpoint"]["policy"] == "hypernet" and out["base"]["policy"] == "base"
    assert all(t["adapter"] is None for t in out["base"]["per_task"])
    assert [t["prompt_tokens"] for t in out["base"]["per_task"]] == [
        t["prompt_tokens"] for t in result["per_task"]
    ]  # the base model was asked the same bare question
    assert "internalized 3 documents: 0 adapters made, 3 reused" in again.stderr
    # the same tasks with the haystack in the prompt, for scale
    inline = evaluate(EvalOptions(env="niah:words=60", model=str(tiny_model), tasks=1, seed=7,
                                  base_url=server.base_url, max_new_tokens=2))  # fmt: skip
    assert inline["context"] == "prompt"
    assert inline["per_task"][0]["prompt_tokens"] > 3 * result["per_task"][0]["prompt_tokens"]


def test_eval_niah_without_context_scores_one_adapter_and_refusals_are_one_line(
    server, fresh, tiny_model, no_hypernets_server
):
    from rlcli.client.d2l import Hypernets

    adapter = Hypernets(server.base_url).internalize(fresh, FACT)["path"]
    base = ("eval", "rl", "--base-url", server.base_url, "--max-new-tokens", "2", "--tasks", "2")
    scored = cli(*base, "--env", "niah:words=60", "--checkpoint", adapter, "--without-context")
    assert scored.returncode == 0, scored.stderr
    assert "removed (--without-context)" in scored.stdout
    as_json = json.loads(cli(*base, "--env", "niah:words=60", "--checkpoint", adapter,
                             "--without-context", "--json").stdout)  # fmt: skip
    assert as_json["context"] == "removed" and as_json["checkpoint"] == adapter
    assert all(t["prompt"].startswith("What is the magic number of") for t in as_json["per_task"])
    model = ("--model", str(tiny_model))
    one_line(cli(*base, *model, "--env", "arithmetic", "--without-context"),
             "--without-context: --env arithmetic has no context document")  # fmt: skip
    one_line(cli(*base, *model, "--env", "arithmetic", "--hypernet", fresh),
             "--hypernet: --env arithmetic has no context document")  # fmt: skip
    one_line(cli(*base, "--env", "niah", "--hypernet", fresh, "--checkpoint", adapter),
             "--hypernet with --checkpoint")  # fmt: skip
    one_line(cli(*base, "--env", "niah", "--hypernet", adapter),
             "a sampler_weights checkpoint (a LoRA adapter), not a hypernetwork")  # fmt: skip
    # 400 words is ~1,400 tokens: more than this hypernetwork's 8 chunks of 64
    one_error(cli(*base, "--env", "niah:words=400", "--hypernet", fresh),
             "task test-0-0: refused by the server (400): document: the document has")  # fmt: skip
    one_line(cli("eval", "rl", "--env", "niah", "--hypernet", fresh, "--base-url",
                 no_hypernets_server), "(jax) hosts no hypernetworks")  # fmt: skip


def test_eval_niah_hypernet_takes_a_haystack_longer_than_the_models_window(server, tiny_model):
    """1,300 words is ~4,500 tokens, past the tiny model's 4,096 positions: in the prompt it
    could not be read at once; the hypernetwork reads it in 9 chunks of 512."""
    from rlcli.client.d2l import Hypernets
    from rlcli.client.evaluate import EvalOptions, evaluate

    window = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    hypernets = Hypernets(server.base_url)
    made = hypernets.create(seed=0, rank=2, latent=8, chunk_tokens=512, max_chunks=16)
    path = hypernets.save(made["hypernet_id"], "long")["path"]
    hypernets.remove(made["hypernet_id"])
    result = evaluate(EvalOptions(env="niah:words=1300", hypernet=path, tasks=1,
                                  base_url=server.base_url, max_new_tokens=2))  # fmt: skip
    assert result["internalized"]["document_tokens_max"] > window
    assert result["tasks"] == 1 and result["per_task"][0]["prompt_tokens"] < 60

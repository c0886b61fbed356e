"""What capture costs the OpenAI-compatible endpoint: ``/v1/chat/completions`` throughput on
SmolLM2-135M-Instruct with capture off, on (``--capture``), and on with ``--redact``, under
concurrent clients.

Three servers of the same model run side by side; rounds alternate between them (off, on,
redact, off, ...) so that load from anything else on the machine falls on all three alike.
A round is ``--clients`` clients at once, each asking one chat answer of exactly ``--tokens``
tokens (``ignore_eos``) that contains an email and a phone number (so ``--redact`` has work);
throughput is the round's completion tokens over its wall time. The ratio is the median of
capture's rounds over the median of capture-off's. Target (issue 43): under 3% overhead.
On a shared machine the rounds' spread can dwarf 3%, so the receipt also has what the writer
thread costs per record, measured alone in this process on the records just captured
(``writer_ms_per_record``: serialize + append, and with redaction), beside the mean request
latency it would be added to.
At the end every captured line is counted (all requests are there) and the redacted files
are checked to hold no planted value.

    flock /tmp/rlcli-heavy.lock python benchmarks/capture_overhead.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402
from rl_gsm8k_smollm2 import smollm2_folder  # noqa: E402

EMAIL, PHONE = "ada.lovelace@example.com", "+1 415 555 0100"
ASK = f"Write to {EMAIL} or call {PHONE}, then tell me a long story about a dragon."
CONFIGS = {"off": [], "capture": ["--capture"], "capture_redact": ["--capture", "--redact"]}


def _round(base_url: str, model: str, clients: int, tokens: int, seed: int) -> dict:
    import httpx

    results: list[int] = [0] * clients
    barrier = threading.Barrier(clients + 1)

    def one(i: int) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": ASK}],
                "max_tokens": tokens, "ignore_eos": True, "seed": seed * 100 + i}  # fmt: skip
        barrier.wait()
        reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
        reply.raise_for_status()
        results[i] = reply.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(results), "tokens_per_s": sum(results) / wall}


def writer_cost(records: list[dict], folder: Path) -> dict:
    """Milliseconds of the capture writer's work per record (what the thread does beside the
    endpoint), plain and with --redact, on these records."""
    from rlcli.server.state.capture import Capture

    out = {}
    for name, redact in (("capture", False), ("capture_redact", True)):
        capture = Capture(folder / name, redact=redact)
        t0 = time.perf_counter()
        for record in records:
            capture._write(dict(record))
        out[name] = 1000 * (time.perf_counter() - t0) / len(records)
        capture.close()
    return out


def _server_args(name: str, folder: Path) -> list[str]:
    args = []
    if "--capture" in CONFIGS[name]:
        args += ["--capture", str(folder / name)]
    if "--redact" in CONFIGS[name]:
        args.append("--capture-redact")
    return args


def run(model: str, rounds: int, clients: int, tokens: int) -> dict:
    raw: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp) / "captures"
        servers = {
            name: stack.enter_context(
                _receipt.local_server(
                    model, Path(tmp) / name, dtype="float32", extra_args=_server_args(name, folder)
                )  # fmt: skip
            )
            for name in CONFIGS
        }
        for record in servers.values():  # warm up: the tokenizer, the redactor, a batch
            _round(record.base_url, model, clients, 4, seed=0)
        for r in range(rounds):
            for name, record in servers.items():
                raw[name].append(_round(record.base_url, model, clients, tokens, seed=r + 1))
        stack.close()  # SIGTERM: every capture queue drained
        captured = {}
        for name in ("capture", "capture_redact"):
            text = "".join(p.read_text() for p in sorted((folder / name).glob("traces-*.jsonl")))
            lines = [json.loads(line) for line in text.splitlines()]
            if name == "capture":
                writer = writer_cost(lines, Path(tmp) / "writer")
            captured[name] = {
                "lines": len(lines),
                "expected": clients * (rounds + 1),
                "planted_values_left": sum(text.count(v) for v in (EMAIL, PHONE)),
            }
    medians = {
        name: statistics.median(r["tokens_per_s"] for r in rows) for name, rows in raw.items()
    }
    return {
        "raw": raw,
        "median_tokens_per_s": medians,
        "ratio_vs_off": {name: medians[name] / medians["off"] for name in CONFIGS},
        "overhead_percent": {name: 100 * (1 - medians[name] / medians["off"]) for name in CONFIGS},
        "captured": captured,
        "writer_ms_per_record": writer,
        "mean_request_latency_s": statistics.fmean(
            r["latency_s"] for r in lines if "latency_s" in r
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--name", default="capture_overhead")
    args = parser.parse_args()
    _receipt.exit_on_sigterm()
    model = args.model or str(smollm2_folder(Path.home() / ".cache" / "rlcli-bench" / "smollm2"))
    result = run(model, args.rounds, args.clients, args.tokens)
    settings = {"model": model, "rounds": args.rounds, "clients": args.clients,
                "max_tokens": args.tokens, "target": "capture under 3% overhead"}  # fmt: skip
    path = _receipt.write(args.name, {**settings, **result})
    print(path)
    print(json.dumps({k: result[k] for k in ("overhead_percent", "captured")}, indent=2))


if __name__ == "__main__":
    main()

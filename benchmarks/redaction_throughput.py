"""PII redaction throughput (rlcli.data.redaction): messages per second on generated chat rows.

The rows look like support traffic an agent serves: a system prompt, a user turn, an assistant
tool call whose arguments carry the customer's details, the tool's JSON output, and the answer;
a share of the turns hold emails, phone numbers, card numbers and IPs (in content, tool
arguments and tool outputs), the rest is plain text. Measured: the Redactor built once (its
build time apart), then ``redact_conversation`` over every row, ``--rounds`` times; each round's
messages/s and rows/s, and what was redacted (checked against what was planted).

    .venv/bin/python benchmarks/redaction_throughput.py [--rows 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402

FIRST = ["ada", "bob", "chen", "dara", "eli", "fatima", "goran", "hana", "ivan", "jo"]
DOMAINS = ["example.com", "mail.example.org", "corp.example.net", "shop.example.co.uk"]
PLAIN = [
    "Thanks, that helps a lot.",
    "Can you check the status of my last order? It has not arrived yet.",
    "I would like to change the delivery address to my office for next week.",
    "The app keeps logging me out after a few minutes, is that expected?",
    "Please summarise what we discussed and the next steps.",
]


def _phone(rng):
    return rng.choice(
        [f"+1 415-555-{rng.randint(1000, 9999)}", f"(212) 555-{rng.randint(1000, 9999)}",
         f"+44 20 7946 {rng.randint(1000, 9999)}"]
    )  # fmt: skip


def _card(rng):
    return rng.choice(["4111 1111 1111 1111", "5500 0000 0000 0004", "3400 0000 0000 009"])


def _ip(rng):
    return f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"


def make_row(rng: random.Random) -> tuple[dict, int]:
    """One conversation and how many PII values were planted in it."""
    name = rng.choice(FIRST)
    email = f"{name}.{rng.randint(1, 999)}@{rng.choice(DOMAINS)}"
    phone, card, ip = _phone(rng), _card(rng), _ip(rng)
    pii = rng.random() < 0.6  # 40% of conversations hold no PII at all
    user = (
        f"Hi, I'm {name}, email {email}, phone {phone}. My card {card} was charged twice "
        f"when I ordered from {ip}."
        if pii
        else rng.choice(PLAIN)
    )
    arguments = {"email": email, "phone": phone} if pii else {"order": rng.randint(1000, 9999)}
    output = (
        {"customer": email, "last_login_ip": ip, "orders": [{"id": 17, "total": 42.5}]}
        if pii
        else {"orders": [{"id": 17, "status": "shipped"}]}
    )
    row = {
        "messages": [
            {"role": "system", "content": "You are a support agent for an online shop."},
            {"role": "user", "content": user},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "lookup_customer", "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "lookup_customer",
             "content": json.dumps(output)},
            {"role": "assistant", "content": rng.choice(PLAIN)
             + (f" I have sent the refund confirmation to {email}." if pii else "")},
        ],
        "feedback": [{"key": "resolved", "score": 1, "value": None, "comment": None,
                      "correction": None, "source": "api"}],
    }  # fmt: skip
    planted = (4 + 2 + 2 + 1) if pii else 0  # user 4, arguments 2, output 2, answer 1
    return row, planted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="redaction_throughput")
    args = parser.parse_args()

    from rlcli.data.redaction import RedactionReport, Redactor

    rng = random.Random(args.seed)
    made = [make_row(rng) for _ in range(args.rows)]
    rows, planted = [r for r, _ in made], sum(n for _, n in made)
    messages = sum(len(r["messages"]) for r in rows)

    t0 = time.perf_counter()
    redactor = Redactor()
    build = time.perf_counter() - t0

    rounds, report = [], None
    for _ in range(args.rounds):
        report = RedactionReport()
        t0 = time.perf_counter()
        for row in rows:
            _, found = redactor.redact_conversation(row)
            report.add(found)
        seconds = time.perf_counter() - t0
        rounds.append({"seconds": seconds, "messages_per_s": messages / seconds,
                       "rows_per_s": len(rows) / seconds})  # fmt: skip
        print(f"{seconds:.2f} s: {messages / seconds:.0f} messages/s", flush=True)
    found = sum(report.replaced.values())
    best = max(r["messages_per_s"] for r in rounds)
    median = sorted(r["messages_per_s"] for r in rounds)[len(rounds) // 2]
    path = _receipt.write(args.name, {
        "rows": len(rows), "messages": messages, "pii_values_planted": planted,
        "pii_values_redacted": found, "redacted_by_type": dict(report.replaced),
        "rows_changed": report.rows_changed, "redactor_build_s": build, "rounds": rounds,
        "messages_per_s_median": median, "messages_per_s_best": best,
        "entities": redactor.entities,
    })  # fmt: skip
    print(f"median {median:.0f} messages/s ({found} of {planted} planted values redacted); {path}")


if __name__ == "__main__":
    main()

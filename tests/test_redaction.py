"""PII redaction (rlcli.data.redaction, `rlcli redact`, `import --redact`): what it finds, where,
the same placeholder for the same value across a conversation, idempotence, a user's NER model,
the report, and fail-closed output."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from conftest import cli, run_rlcli
from rlcli.data.redaction import RedactionError, Redactor

DATA = Path(__file__).parent / "data" / "imports"
EMAIL, PHONE, CARD, IP = "ada@example.com", "+1 415-555-0132", "4111 1111 1111 1111", "10.0.0.12"


@pytest.fixture(scope="module")
def redactor() -> Redactor:
    return Redactor()


def conversation() -> dict:
    """PII in user content, in tool-call arguments, in a tool's output and in feedback."""
    arguments = json.dumps({"email": EMAIL.upper(), "phone": "(415) 555-0132", "card": CARD})
    return {
        "messages": [
            {"role": "system", "content": "You help with billing."},
            {"role": "user", "content": f"I'm {EMAIL}, call {PHONE}; card {CARD}, from {IP}."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "lookup", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "lookup",
             "content": json.dumps({"owner": EMAIL, "last_ip": IP, "other": "bob@corp.io"})},
            {"role": "assistant", "content": f"Found {EMAIL}, last seen at {IP}."},
        ],
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
        "feedback": [{"key": "ok", "score": 1, "value": None, "comment": "mail bob@corp.io",
                      "correction": None, "source": "api"}],
        "origin": {"format": "langsmith", "trace_id": "555-0132", "call_id": "4111111111111111"},
    }  # fmt: skip


def test_pii_in_content_tool_arguments_and_tool_outputs_gets_one_placeholder_per_value(redactor):
    row, report = redactor.redact_conversation(conversation())
    user, call, tool, answer = (m for m in row["messages"][1:])
    assert (
        user["content"]
        == "I'm <EMAIL_1>, call <PHONE_1>; card <CREDIT_CARD_1>, from <IP_ADDRESS_1>."
    )
    # the same email (other case) and phone (other spelling) in the tool call: same placeholders
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {
        "email": "<EMAIL_1>", "phone": "<PHONE_1>", "card": "<CREDIT_CARD_1>"
    }  # fmt: skip
    assert json.loads(tool["content"]) == {
        "owner": "<EMAIL_1>", "last_ip": "<IP_ADDRESS_1>", "other": "<EMAIL_2>"
    }  # fmt: skip
    assert answer["content"] == "Found <EMAIL_1>, last seen at <IP_ADDRESS_1>."
    assert row["feedback"][0]["comment"] == "mail <EMAIL_2>"
    # structure is never redacted: ids, names, roles, where the row came from
    assert call["tool_calls"][0]["id"] == "call_1" and tool["name"] == "lookup"
    assert row["origin"] == conversation()["origin"]
    assert report.as_dict() == {
        "rows": 1, "rows_changed": 1,
        "replaced": {"CREDIT_CARD": 2, "EMAIL": 6, "IP_ADDRESS": 3, "PHONE": 2},
        "distinct": {"CREDIT_CARD": 1, "EMAIL": 2, "IP_ADDRESS": 1, "PHONE": 1},
    }  # fmt: skip
    assert EMAIL not in json.dumps(report.as_dict()) and "EMAIL 6" in report.summary()


def test_placeholders_start_again_in_each_conversation(redactor):
    first, _ = redactor.redact_conversation({"messages": [{"role": "user", "content": EMAIL}]})
    other = {"messages": [{"role": "user", "content": "x@y.org and " + EMAIL}]}
    second, _ = redactor.redact_conversation(other)
    assert first["messages"][0]["content"] == "<EMAIL_1>"
    assert second["messages"][0]["content"] == "<EMAIL_1> and <EMAIL_2>"


def test_redacting_twice_changes_nothing_more(redactor):
    once, _ = redactor.redact_conversation(conversation())
    twice, report = redactor.redact_conversation(once)
    assert twice == once and report.rows_changed == 0 and not report.replaced
    # a value new to a redacted row gets the next number, never one already used
    once["messages"].append({"role": "user", "content": "also carol@example.org"})
    grown, _ = redactor.redact_conversation(once)
    assert grown["messages"][-1]["content"] == "also <EMAIL_3>"


def test_no_network_is_asked(redactor, monkeypatch):
    """Presidio's email check goes through tldextract, whose default extractor would fetch the
    public suffix list; ours reads tldextract's own snapshot (offline_public_suffixes)."""
    import tldextract.tldextract as tld

    def refuse(*args, **kwargs):
        raise AssertionError("redaction opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    assert tld.TLD_EXTRACTOR.suffix_list_urls == ()
    row, _ = redactor.redact_conversation({"messages": [{"role": "user", "content": EMAIL}]})
    assert row["messages"][0]["content"] == "<EMAIL_1>"


def test_a_spacy_ner_folder_adds_names_and_stays_idempotent(tmp_path):
    """A user's spaCy pipeline (here: an entity ruler saved to disk, no download) finds names;
    a placeholder it would also match is left alone."""
    import spacy

    nlp = spacy.blank("en")
    ruler = nlp.add_pipe("entity_ruler")
    ruler.add_patterns([
        {"label": "PERSON", "pattern": "Ada Lovelace"},
        {"label": "ORG", "pattern": [{"TEXT": {"REGEX": "^PERSON_"}}]},  # matches placeholders
    ])  # fmt: skip
    nlp.to_disk(tmp_path / "ner")
    named = Redactor(ner_model=str(tmp_path / "ner"))
    row = {"messages": [{"role": "user", "content": f"Ada Lovelace here, {EMAIL}."}]}
    once, report = named.redact_conversation(row)
    assert once["messages"][0]["content"] == "<PERSON_1> here, <EMAIL_1>."
    assert report.replaced == {"PERSON": 1, "EMAIL": 1}
    assert named.redact_conversation(once)[0] == once


def test_a_transformers_ner_folder_loads_offline(tmp_path):
    """A token-classification folder runs as Presidio's HuggingFace NER recognizer. This tiny
    model is built here and says B-PER for every token, so every word is a name."""
    import torch
    from transformers import BertConfig, BertForTokenClassification, BertTokenizerFast

    folder = tmp_path / "bert-ner"
    folder.mkdir()
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "ada", "wrote"]))
    labels = {0: "O", 1: "B-PER", 2: "I-PER"}
    config = BertConfig(
        vocab_size=7, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
        intermediate_size=8, id2label=labels, label2id={v: k for k, v in labels.items()},
    )  # fmt: skip
    model = BertForTokenClassification(config)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([0.0, 10.0, 0.0]))
    model.save_pretrained(folder)
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(folder)
    row, report = Redactor(ner_model=str(folder)).redact_conversation(
        {"messages": [{"role": "user", "content": "ada wrote"}]}
    )
    assert "ada" not in row["messages"][0]["content"] and report.replaced["PERSON"] >= 1


def test_bad_settings_are_one_line(tmp_path):
    with pytest.raises(RedactionError, match="--entities: no recognizer for NOPE"):
        Redactor(["EMAIL_ADDRESS", "NOPE"])
    with pytest.raises(RedactionError, match="no such folder"):
        Redactor(ner_model=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RedactionError, match="neither a spaCy pipeline .* nor a transformers"):
        Redactor(ner_model=str(tmp_path / "empty"))


def _file(tmp_path, rows) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_cli_redacts_to_stdout_or_a_file_with_the_report(tmp_path):
    source = _file(tmp_path, [conversation(), {"messages": [{"role": "user", "content": "hi"}]}])
    result = cli("redact", source)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert rows[0]["messages"][1]["content"].startswith("I'm <EMAIL_1>") and len(rows) == 2
    assert result.stderr == (
        f"{source}: redacted 13 values in 1 of 2 rows: CREDIT_CARD 2, EMAIL 6, IP_ADDRESS 3, "
        "PHONE 2\n"
    )
    out = tmp_path / "clean" / "out.jsonl"
    result = cli("redact", source, "-o", out, "--json", "--entities", "EMAIL_ADDRESS")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["replaced"] == {"EMAIL": 6}
    assert PHONE in out.read_text() and EMAIL not in out.read_text()
    piped = cli("redact", "-", stdin=source.read_text())
    assert piped.returncode == 0 and piped.stdout == cli("redact", source).stdout


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([conversation(), "{oops"], "line 2: not JSON (Expecting property name"),
        ([conversation(), "[1, 2]"], "line 2: expected a JSON object (a conversation), got list"),
        ([], "no rows to redact"),
    ],
)
def test_cli_bad_input_writes_nothing(tmp_path, lines, message):
    source = _file(tmp_path, lines)
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    result = cli("redact", source, "-o", out)
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert out.read_text() == "precious\n"
    result = cli("redact", source)
    assert result.returncode == 1 and result.stdout == ""


def test_cli_refuses_what_it_cannot_read(tmp_path):
    result = cli("redact", tmp_path / "nope.jsonl")
    assert result.returncode == 1 and "nope.jsonl: no such file" in result.stderr
    binary = tmp_path / "latin1.jsonl"
    binary.write_bytes(b'{"messages": []}\n{"a": "caf\xe9"}\n')
    result = cli("redact", binary)
    assert result.returncode == 1 and "line 2: not UTF-8 text; nothing written" in result.stderr
    result = cli("redact", binary, "--entities", "EMAIL_ADDRESS,SHOE_SIZE")
    assert result.returncode == 1 and "--entities: no recognizer for SHOE_SIZE" in result.stderr
    result = cli("redact", binary, "--ner-model", tmp_path / "nowhere")
    assert (
        result.returncode == 1
        and "--ner-model" in result.stderr
        and "no such folder" in result.stderr
    )
    result = cli("import", binary, "-f", "langsmith", "--entities", "EMAIL_ADDRESS")
    assert result.returncode == 1 and "add --redact" in result.stderr


def test_a_failing_redaction_writes_nothing(tmp_path, monkeypatch):
    """Fail-closed: the redactor breaks on the second row; neither -o nor stdout gets the
    first row, and a file already at -o is left as it was."""
    original = Redactor.redact_text

    def breaks_on_bob(self, text, conversation):
        if "bob" in text:
            raise RuntimeError("the NER model crashed")
        return original(self, text, conversation)

    monkeypatch.setattr(Redactor, "redact_text", breaks_on_bob)
    source = _file(tmp_path, [
        {"messages": [{"role": "user", "content": EMAIL}]},
        {"messages": [{"role": "user", "content": "bob@corp.io"}]},
    ])  # fmt: skip
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    result = cli("redact", source, "-o", out)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: {source}: line 2: redaction failed: RuntimeError: the NER model crashed; "
        "nothing written"
    )
    assert out.read_text() == "precious\n" and list(tmp_path.glob(".out.jsonl.*")) == []
    result = cli("redact", source)
    assert result.returncode == 1 and result.stdout == ""
    imported = cli("import", DATA / "langsmith" / "openai_agent.jsonl", "-f", "langsmith",
                   "--redact", "-o", out)  # fmt: skip
    assert imported.returncode == 0, imported.stderr  # no "bob" in that file
    monkeypatch.setattr(
        Redactor, "redact_text", lambda *a, **k: (_ for _ in ()).throw(OSError("x"))
    )
    out.write_text("precious\n")
    failed = cli("import", DATA / "langsmith" / "openai_agent.jsonl", "-f", "langsmith",
                 "--redact", "-o", out)  # fmt: skip
    assert failed.returncode == 1 and "conversation 1: redaction failed: OSError" in failed.stderr
    assert out.read_text() == "precious\n"


def test_import_redact_cleans_trace_rows(tmp_path):
    result = cli("import", DATA / "otel" / "openinference.jsonl", "-f", "otel", "--redact")
    assert result.returncode == 0, result.stderr
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert row["messages"][1]["content"] == "Book 3pm with <EMAIL_1>"
    arguments = json.loads(row["messages"][2]["tool_calls"][0]["function"]["arguments"])
    assert arguments == {"time": "15:00", "with": "<EMAIL_1>"}
    assert "redacted 2 values in 1 of 1 rows: EMAIL 2" in result.stderr


def test_redact_as_a_command():
    """One real process: the console script, stdin to stdout."""
    row = {"messages": [{"role": "user", "content": f"ping {IP}"}]}
    result = run_rlcli("redact", "-", stdin=json.dumps(row) + "\n")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["messages"][0]["content"] == "ping <IP_ADDRESS_1>"


def test_the_cheap_checks_before_presidio_lose_nothing(redactor, monkeypatch):
    """``NEEDS`` skips recognizers that cannot match a text; with it off (every recognizer on
    every string) the same texts come out the same, edge cases included."""
    import rlcli.data.redaction as redaction

    texts = [
        "call 020 7946 0958 or +49 30 901820", "ssn 078-05-1120 / 219-09-9999",
        "amex 3400 0000 0000 009", "NO93 8601 1117 947 and DE89 3704 0044 0532 0130 00",
        "ipv6 dead:beef::cafe and ::1 and 192.168.0.1", "a@b.co", "nothing here at all",
        "order 12345 shipped", json.dumps({"ip": "10.1.2.3", "tel": "(415) 555-0132"}),
    ]  # fmt: skip
    rows = [{"messages": [{"role": "user", "content": t}]} for t in texts]
    fast = [redactor.redact_conversation(r)[0] for r in rows]
    monkeypatch.setattr(redaction, "NEEDS", {})
    assert [redactor.redact_conversation(r)[0] for r in rows] == fast
    assert fast[4]["messages"][0]["content"] != texts[4]  # the IPs were found at all

"""PII redaction for conversations, offline: Presidio's analyzer finds, its anonymizer replaces.

Why this setup: Presidio's default NLP engine loads a spaCy model it downloads; ours is
Presidio's own ``no_op`` engine (no model, no tokens), under which only self-contained
recognizers run, and the ones we run validate what their pattern finds (Luhn for cards, the
``phonenumbers`` library for phones, ``ipaddress`` rules, a public-suffix check for emails),
so they need no context words from a tokenizer. A spaCy pipeline folder or a transformers
token-classification folder (``ner_model``) adds names, places and organisations.

The invariants, enforced here and only here:

- same value -> same placeholder across one conversation (every string in the row: message
  content, tool-call arguments, tool outputs, feedback comments and corrections), ``<EMAIL_1>``,
  ``<PHONE_2>``; values compare normalized (emails by lower case, numbers by their digits);
- idempotent: a placeholder is never redacted again, and numbering continues after the
  placeholders a row already holds, so redacting twice changes nothing more;
- fail-closed: ``redact_conversation`` returns the whole row redacted or raises
  ``RedactionError``; callers write nothing on an error (``rlcli redact``, ``import --redact``);
- the report says what was redacted by type and count, never the values.

The server may import this module (``serve start --capture --redact``): it imports nothing of
rlcli's client layers, and Presidio only when a ``Redactor`` is built.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from rlcli.errors import RlcliError

# Validated pattern recognizers (see above); weaker ones (US_BANK_NUMBER, DATE_TIME, URL, ...)
# can be asked for by name with ``entities``.
DEFAULT_ENTITIES = ("EMAIL_ADDRESS", "PHONE_NUMBER", "CREDIT_CARD", "IP_ADDRESS", "IBAN_CODE",
                    "US_SSN")  # fmt: skip
NER_ENTITIES = ("PERSON", "LOCATION", "ORGANIZATION")
# Placeholder names: short where Presidio's are long, the entity's own name elsewhere.
LABELS = {"EMAIL_ADDRESS": "EMAIL", "PHONE_NUMBER": "PHONE", "IBAN_CODE": "IBAN"}
PLACEHOLDER = re.compile(r"<([A-Z][A-Z0-9_]*?)_(\d+)>")
MARK = ("\ue000", "\ue001")  # private-use characters around a marker's number, mid-redaction
MARKED = re.compile(f"{MARK[0]}(\\d+){MARK[1]}")
# Keys whose values are structure, not text: never redacted (an id, a role, a tool's name).
STRUCTURE_KEYS = frozenset({"role", "type", "id", "tool_call_id", "name", "key", "source",
                            "origin", "finish_reason", "model", "index"})  # fmt: skip
LANGUAGE = "en"


class RedactionError(RlcliError):
    """Redaction could not finish; nothing redacted from that row may be written."""


def label(entity: str) -> str:
    return LABELS.get(entity, entity)


@dataclass
class RedactionReport:
    """What was redacted, by placeholder type: ``replaced`` counts occurrences, ``distinct``
    the placeholders made (one per value per conversation). Never the values."""

    rows: int = 0
    rows_changed: int = 0
    replaced: Counter = field(default_factory=Counter)
    distinct: Counter = field(default_factory=Counter)

    def add(self, other: RedactionReport) -> None:
        self.rows += other.rows
        self.rows_changed += other.rows_changed
        self.replaced.update(other.replaced)
        self.distinct.update(other.distinct)

    def as_dict(self) -> dict:
        return {
            "rows": self.rows,
            "rows_changed": self.rows_changed,
            "replaced": dict(sorted(self.replaced.items())),
            "distinct": dict(sorted(self.distinct.items())),
        }

    def summary(self) -> str:
        total = sum(self.replaced.values())
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(self.replaced.items()))
        head = f"redacted {total} values in {self.rows_changed} of {self.rows} rows"
        return f"{head}: {kinds}" if kinds else head


class _Conversation:
    """One row's placeholders: value -> placeholder, and the next number per type (after the
    highest the row already holds)."""

    def __init__(self, existing: list[str]) -> None:
        self.placeholders: dict[tuple[str, str], str] = {}
        self.numbers: Counter = Counter()
        for text in existing:
            for kind, number in PLACEHOLDER.findall(text):
                self.numbers[kind] = max(self.numbers[kind], int(number))
        self.report = RedactionReport(rows=1)

    def placeholder(self, kind: str, value: str) -> str:
        self.report.replaced[kind] += 1
        key = (kind, _normalized(kind, value))
        if key not in self.placeholders:
            self.numbers[kind] += 1
            self.report.distinct[kind] += 1
            self.placeholders[key] = f"<{kind}_{self.numbers[kind]}>"
        return self.placeholders[key]


def _normalized(kind: str, value: str) -> str:
    """One spelling per value: emails in lower case, phone numbers in E.164 (``phonenumbers``,
    Presidio's own phone parser; a number without a country code is read as US, the
    recognizer's first region), other numbers by their letters and digits."""
    if kind == "EMAIL":
        return value.strip().lower()
    if kind == "PHONE":
        import phonenumbers

        try:
            number = phonenumbers.parse(value, "US")
            return phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
        except phonenumbers.NumberParseException:
            pass
    if kind in ("PHONE", "CREDIT_CARD", "US_SSN", "IBAN"):
        return re.sub(r"[^0-9A-Za-z]", "", value).upper()
    return value.strip()


class Redactor:
    """``Redactor().redact_conversation(row) -> (row, report)``; build once, use for many rows
    (building loads Presidio: about a second)."""

    def __init__(
        self, entities: tuple[str, ...] | list[str] | None = None, ner_model: str | None = None
    ) -> None:
        self.analyzer, self.anonymizer, found = _engines(ner_model)
        wanted = list(entities or DEFAULT_ENTITIES) + (list(NER_ENTITIES) if ner_model else [])
        unknown = sorted(set(entities or ()) - set(found))
        if unknown:
            raise RedactionError(
                f"--entities: no recognizer for {', '.join(unknown)} "
                f"(known: {', '.join(sorted(found))})"
            )
        self.entities = [e for e in dict.fromkeys(wanted) if e in found]

    def redact_conversation(self, row):
        """The row with every PII value in its text replaced by a placeholder, and what was
        replaced. Raises ``RedactionError`` (never returns half a row)."""
        texts: list[str] = []
        _walk(row, texts.append)
        conversation = _Conversation(texts)
        try:
            redacted = _walk(row, partial(self.redact_text, conversation=conversation))
        except RedactionError:
            raise
        except Exception as e:  # Presidio, a NER model: whatever fails, fails the row
            raise RedactionError(f"redaction failed: {type(e).__name__}: {e}") from e
        report = conversation.report
        report.rows_changed = 1 if report.replaced else 0
        return redacted, report

    def redact_text(self, text: str, conversation: _Conversation) -> str:
        if not text.strip():
            return text
        entities = _possible(text, self.entities)
        if not entities:
            return text
        kept = [(m.start(), m.end()) for m in PLACEHOLDER.finditer(text)]
        results = [
            r
            for r in self.analyzer.analyze(text=text, language=LANGUAGE, entities=entities)
            if not any(r.start < end and start < r.end for start, end in kept)
        ]
        if not results:
            return text
        from presidio_anonymizer.entities import OperatorConfig

        # The anonymizer resolves overlaps and replaces from the end of the text; it writes
        # markers, numbered here in reading order, so <EMAIL_1> is the first email one reads.
        found: list[tuple[str, str]] = []

        def mark(kind: str, value: str) -> str:
            found.append((kind, value))
            return f"{MARK[0]}{len(found) - 1}{MARK[1]}"

        operators = {
            r.entity_type: OperatorConfig("custom", {"lambda": partial(mark, label(r.entity_type))})
            for r in results
        }
        marked = self.anonymizer.anonymize(text, results, operators=operators).text
        return MARKED.sub(lambda m: conversation.placeholder(*found[int(m.group(1))]), marked)


# What a text must hold for a recognizer to find anything in it: each is a necessary condition
# of that recognizer's own patterns (an email has an @, a card 12+ digits, a phone number that
# ``phonenumbers`` calls valid 5+ ...), checked first because most strings hold none, and the
# phone recognizer (8 regions, one ``phonenumbers`` pass each) is 3/4 of the time otherwise.
# Entities not listed (a NER model's, any asked for by name) always run.
def _digits(n: int):
    return lambda text, digits: digits >= n


NEEDS = {
    "EMAIL_ADDRESS": lambda text, digits: "@" in text,
    "PHONE_NUMBER": _digits(5),
    "CREDIT_CARD": _digits(12),
    "US_SSN": _digits(9),
    "IBAN_CODE": _digits(8),
    "IP_ADDRESS": lambda text, digits: digits >= 4 or ":" in text,
}


def _possible(text: str, entities: list[str]) -> list[str]:
    digits = sum(c.isdigit() for c in text)
    return [e for e in entities if e not in NEEDS or NEEDS[e](text, digits)]


def _walk(node, visit):
    """``node`` with ``visit`` applied to every string outside STRUCTURE_KEYS (keys stay)."""
    if isinstance(node, str):
        return visit(node)
    if isinstance(node, list):
        return [_walk(item, visit) for item in node]
    if isinstance(node, dict):
        return {k: v if k in STRUCTURE_KEYS else _walk(v, visit) for k, v in node.items()}
    return node


def _engines(ner_model: str | None):
    """Presidio's analyzer (offline: no_op engine, or the user's NER model) and anonymizer,
    and the entity names its recognizers cover."""
    try:
        from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
        from presidio_analyzer.nlp_engine import NlpEngineProvider
        from presidio_anonymizer import AnonymizerEngine
    except ImportError as e:
        raise RedactionError(
            f"PII redaction needs Presidio ({e.name} is not installed): pip install 'rlcli[redact]'"
        ) from None
    logging.getLogger("presidio-analyzer").setLevel(logging.ERROR)
    offline_public_suffixes()
    extra = []
    if ner_model is None:
        engine = _no_op_engine(NlpEngineProvider)
    else:
        engine, extra = _ner_engine(Path(ner_model), NlpEngineProvider)
    registry = RecognizerRegistry(supported_languages=[LANGUAGE])
    registry.load_predefined_recognizers(languages=[LANGUAGE], nlp_engine=engine)
    for recognizer in extra:
        registry.add_recognizer(recognizer)
    analyzer = AnalyzerEngine(nlp_engine=engine, registry=registry, supported_languages=[LANGUAGE])
    found = set(analyzer.get_supported_entities(language=LANGUAGE))
    return analyzer, AnonymizerEngine(), found


def _no_op_engine(provider):
    config = {
        "nlp_engine_name": "no_op",
        "models": [{"lang_code": LANGUAGE, "model_name": "no_op"}],
    }
    return provider(nlp_configuration=config).create_engine()


def _ner_engine(folder: Path, provider):
    """A spaCy pipeline folder (``config.cfg`` + ``meta.json``) runs as Presidio's spaCy engine;
    a transformers token-classification folder (``config.json``) as its HuggingFace NER
    recognizer beside the no_op engine. Either is read from disk, never downloaded."""
    where = f"--ner-model {folder}"
    if not folder.is_dir():
        raise RedactionError(f"{where}: no such folder")
    if (folder / "config.cfg").is_file() and (folder / "meta.json").is_file():
        config = {"nlp_engine_name": "spacy",
                  "models": [{"lang_code": LANGUAGE, "model_name": str(folder)}]}  # fmt: skip
        try:
            return provider(nlp_configuration=config).create_engine(), []
        except Exception as e:
            raise RedactionError(f"{where}: not a spaCy pipeline spaCy can load: {e}") from e
    if (folder / "config.json").is_file():
        from presidio_analyzer.predefined_recognizers.ner.huggingface_ner_recognizer import (
            HuggingFaceNerRecognizer,
        )

        recognizer = HuggingFaceNerRecognizer(
            model_name=str(folder),
            supported_language=LANGUAGE,
            supported_entities=list(NER_ENTITIES),
        )
        try:
            recognizer.load()
        except Exception as e:
            raise RedactionError(f"{where}: not a token-classification model: {e}") from e
        return _no_op_engine(provider), [recognizer]
    raise RedactionError(
        f"{where}: neither a spaCy pipeline (config.cfg, meta.json) nor a transformers model "
        "(config.json)"
    )


def offline_public_suffixes() -> None:
    """Presidio's email recognizer validates domains with ``tldextract.extract``, whose default
    extractor fetches the public suffix list from the internet on first use (and waits for it
    to fail offline); point it at the snapshot tldextract ships. The one place that knows
    tldextract's internals; tests/test_redaction.py fails if they move."""
    import tldextract.tldextract as tld

    if not hasattr(tld, "TLD_EXTRACTOR") or not hasattr(tld, "TLDExtract"):
        raise RedactionError("tldextract moved its default extractor; see rlcli.data.redaction")
    if tld.TLD_EXTRACTOR.suffix_list_urls:
        tld.TLD_EXTRACTOR = tld.TLDExtract(suffix_list_urls=(), cache_dir=None)

"""``rlcli internalize DOCUMENT --hypernet PATH``: the doc-to-LoRA route of ``internalize``.

One forward pass of a trained hypernetwork (``rlcli train d2l``) makes the document's adapter on
the server: no probes, no teacher, no training, so no run folder either. The work is
``client/d2l.internalize_text``, the same call behind ``rlcli hypernet internalize``; this
module reads the document as the context-distillation route does (``data/documents.py``: empty,
binary and oversized documents refused alike), refuses flags that only mean something to
context distillation, and shapes the answer like that route's summary (``sampler_path``).

One document per call: a hypernetwork makes one adapter from one document, and several
documents would need several adapters (or one concatenated text whose chunks straddle them),
so several are refused in one line rather than guessed at.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlcli.data import documents as docs_mod
from rlcli.errors import RlcliError
from rlcli.flags import flag

# What --hypernet takes; every other option must stay at its default with it.
HYPERNET_FIELDS = frozenset(
    {"documents", "model", "base_url", "hypernet", "session_key", "ttl", "pin", "json", "config"}
)
HYPERNET_ONLY = ("session_key", "ttl", "pin")


@dataclass
class Internalized:
    """``rlcli.internalize`` with ``hypernet``: ``summary`` is what ``--json`` prints
    (``sampler_path`` as the context-distillation route's summary has it). No run folder and no
    plan: one forward pass has nothing to resume or plan."""

    summary: dict
    run_dir: None = None
    plan: None = None


def check_mix(opts) -> None:
    """With ``--hypernet``: any context-distillation option off its default is one line; without
    it: ``--session-key``, ``--ttl`` and ``--pin`` are."""
    if not opts.hypernet:
        for name in HYPERNET_ONLY:
            if getattr(opts, name) not in (None, False):
                raise RlcliError(
                    f"{flag(name)}: only with --hypernet (a context-distillation run trains "
                    "its adapter into a run folder; it has no session key or TTL)"
                )
        return
    for field in dataclasses.fields(opts):
        if field.name in HYPERNET_FIELDS or field.default is dataclasses.MISSING:
            continue
        value = getattr(opts, field.name)
        if value != field.default:
            shown = "" if isinstance(value, bool) else f" {value}"
            raise RlcliError(
                f"{flag(field.name)}{shown} with --hypernet: {flag(field.name)} is for context "
                "distillation; --hypernet makes the adapter in one forward pass (no probes, "
                "teacher, training or run folder)"
            )


def run(opts, stdin=None) -> Internalized:
    """The document's adapter through ``opts.hypernet``; every refusal one line."""
    from rlcli.client import d2l

    check_mix(opts)
    d2l.check_hypernet_path(opts.hypernet)
    if opts.model:
        from rlcli.recipes.preflight import check_model_arg

        check_model_arg(opts.model)
    documents = docs_mod.read_documents(list(opts.documents or []), stdin)
    if len(documents) > 1:
        names = ", ".join(d.name for d in documents[:3]) + (", ..." if len(documents) > 3 else "")
        raise RlcliError(
            f"--hypernet: one document per call, got {len(documents)} ({names}); a "
            "hypernetwork makes one adapter from one document: run it once per document"
        )
    document = documents[0]
    out = d2l.internalize_text(
        document.text, opts.hypernet, base_url=opts.base_url, session_key=opts.session_key,
        ttl_seconds=opts.ttl, pin=opts.pin, what=f"DOCUMENT {document.name}", model=opts.model,
    )  # fmt: skip
    summary = {
        "document": document.name,
        "sampler_path": out["path"],
        "hypernet": opts.hypernet,
        "session_key": opts.session_key,
        "reused": out.get("reused"),
        "expires_at": out.get("expires_at"),
        **{k: out.get(k) for k in ("tokens", "chunks", "rank")},
        "seconds": out.get("seconds"),  # the forward pass (None: reused, nothing computed)
    }
    return Internalized(summary)

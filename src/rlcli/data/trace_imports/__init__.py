"""Traces from tracing platforms (LangSmith, Langfuse, OpenTelemetry GenAI) -> training rows.

Each platform has a ``Reader`` (``add(row, line)`` per JSON line, raising ``FormatError``
naming the field; ``collected()`` at the end) that finds LLM calls, tool runs and verdicts;
``assemble`` turns those into ``{"messages", "tools"?, "feedback"}`` rows the same way for
all of them. ``rlcli.data.importers.import_lines`` drives them.
"""

from __future__ import annotations

from rlcli.data.trace_imports import langfuse, langsmith, otel

READERS = {"langsmith": langsmith.Reader, "langfuse": langfuse.Reader, "otel": otel.Reader}
# How an error names what a bad line should have been ("line 3: not an OTLP record: ...").
RECORDS = {"langsmith": "a LangSmith record", "langfuse": "a Langfuse record",
           "otel": "an OTLP record"}  # fmt: skip

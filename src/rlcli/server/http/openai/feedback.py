"""``POST /v1/feedback``: a verdict on a captured exchange, with LangSmith's field names
(``run_id`` is the trace id: the answer's ``id``, also sent as ``x-rlcli-trace-id``). Several
per trace, each one line in the capture folder's ``feedback-*.jsonl`` (``state/capture.py``),
behind the same API key as everything else. A trace this server never captured is a 404; a
score that is not a number, or a comment over ``trace_format.MAX_COMMENT`` characters, a 400
naming the field."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import Field, field_validator

from rlcli import trace_format
from rlcli.server.http.openai.schemas import Body, OpenAIError
from rlcli.server.state.sessions import State

router = APIRouter(prefix="/v1")

Text = Annotated[str, Field(max_length=trace_format.MAX_COMMENT)]


class Feedback(Body):
    run_id: Annotated[str, Field(min_length=1, max_length=256)]
    key: Annotated[str, Field(min_length=1, max_length=trace_format.MAX_KEY)]
    score: Any = None  # a number, true/false (1.0/0.0) or null: checked in ``_score``
    value: Any = None
    comment: Text | None = None
    correction: Text | dict[str, Any] | list[Any] | None = None  # the right answer
    source: Annotated[str, Field(max_length=256)] | dict[str, Any] | None = None
    feedback_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # LangSmith's

    @field_validator("score", mode="before")
    @classmethod
    def _score(cls, value):
        if value is None or isinstance(value, bool):
            return None if value is None else float(value)
        if isinstance(value, int | float) and math.isfinite(value):
            return float(value)
        raise ValueError(f"a finite number, true/false or null (got {value!r})")


@router.post("/feedback")
async def feedback(body: Feedback, state: State):
    for name in ("value", "correction", "source"):
        size = len(json.dumps(getattr(body, name)))
        if size > trace_format.MAX_VALUE:
            raise OpenAIError(
                f"{name}: {size} characters of JSON; at most {trace_format.MAX_VALUE}", name
            )
    capture = state.capture
    if capture is None or not await asyncio.to_thread(capture.has_trace, body.run_id):
        why = "this server captures nothing (serve start --capture)" if capture is None else (
            "no trace with this id was captured here"
        )  # fmt: skip
        raise OpenAIError(f"run_id: {body.run_id!r}: {why}", "run_id", 404, "trace_not_found")
    entry = {
        "v": trace_format.VERSION,
        "id": body.feedback_id or str(uuid.uuid4()),
        "run_id": body.run_id,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "key": body.key,
        "score": body.score,
        "value": body.value,
        "comment": body.comment,
        "correction": body.correction,
        "source": body.source if body.source is not None else "api",
    }
    try:
        await asyncio.to_thread(capture.add_feedback, entry)
    except Exception as e:  # fail-closed redaction, a full disk: nothing was stored
        message = f"feedback not stored: {type(e).__name__}: {e}"
        raise OpenAIError(" ".join(message.split())[:500], None, 500, "server_error") from None
    return {"object": "feedback", **entry}

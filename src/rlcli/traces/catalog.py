"""Read a capture folder: each trace with its verdicts, filtered by time, model, feedback key
and score. Only whole lines count (a line torn by a kill is skipped: ``files/jsonl.py``)."""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from rlcli import trace_format
from rlcli.errors import RlcliError
from rlcli.home import rlcli_home

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def default_folder() -> Path:
    """Where ``serve start --capture`` writes unless told otherwise."""
    return rlcli_home() / "traces"


@dataclass
class Filters:
    since: str | None = None  # ISO time or an age: 30m, 12h, 7d
    until: str | None = None
    model: str | None = None  # the name asked for, or the checkpoint that answered
    key: str | None = None  # has a verdict with this key
    min_score: float | None = None  # a verdict (of --key, if given) scored at least this
    max_score: float | None = None
    limit: int | None = None  # the newest N after filtering


def load(folder: Path | None, filters: Filters | None = None) -> list[dict]:
    """The traces of ``folder`` (oldest first), each with ``feedback``: its verdicts in order."""
    folder = Path(folder or default_folder()).expanduser()
    if not folder.is_dir():
        raise RlcliError(f"{folder}: no capture folder here (serve start --capture writes one)")
    filters = filters or Filters()
    verdicts: dict[str, list[dict]] = defaultdict(list)
    for entry in trace_format.read(folder, trace_format.FEEDBACK):
        verdicts[entry.get("run_id")].append(entry)
    since, until = _when(filters.since, "--since"), _when(filters.until, "--until")
    out = []
    for trace in trace_format.read(folder, trace_format.TRACES):
        trace = {**trace, "feedback": verdicts.get(trace.get("id"), [])}
        if _keep(trace, filters, since, until):
            out.append(trace)
    return out[-filters.limit :] if filters.limit else out


def find(folder: Path | None, trace_id: str) -> dict:
    for trace in load(folder):
        if trace.get("id") == trace_id:
            return trace
    raise RlcliError(f"{trace_id}: no such trace in {folder or default_folder()}")


def _keep(trace: dict, f: Filters, since: str | None, until: str | None) -> bool:
    stamp = trace.get("time", "")
    if (since and stamp < since) or (until and stamp > until):
        return False
    if f.model and f.model not in (trace.get("model"), trace.get("checkpoint")):
        return False
    verdicts = [v for v in trace["feedback"] if f.key is None or v.get("key") == f.key]
    if f.key and not verdicts:
        return False
    if f.min_score is not None or f.max_score is not None:
        low = -float("inf") if f.min_score is None else f.min_score
        high = float("inf") if f.max_score is None else f.max_score
        scores = [v["score"] for v in verdicts if isinstance(v.get("score"), int | float)]
        return any(low <= s <= high for s in scores)
    return True


def _when(text: str | None, flag: str) -> str | None:
    """An ISO time (compared as text: the capture writes UTC ``...Z``) or an age ago."""
    if not text:
        return None
    age = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if age:
        t = time.time() - float(age.group(1)) * UNITS[age.group(2)]
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?Z?)?", text.strip()):
        return text.strip().replace(" ", "T").removesuffix("Z")
    raise RlcliError(f"{flag} {text}: not an ISO time (2026-12-01T09:00) or an age (30m, 12h, 7d)")


def summary(trace: dict) -> dict:
    """One line of ``traces list``."""
    choice = (trace.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    answer = message.get("content") if "message" in choice else choice.get("text", "")
    calls = [c["function"]["name"] for c in message.get("tool_calls") or []]
    asked = ""
    for m in reversed(trace.get("messages") or []):
        if m.get("role") == "user":
            asked = _text(m.get("content"))
            break
    else:
        prompt = trace.get("prompt")
        asked = prompt if isinstance(prompt, str) else ""
    return {
        "id": trace.get("id"),
        "time": trace.get("time"),
        "model": trace.get("checkpoint") or trace.get("model"),
        "endpoint": trace.get("endpoint"),
        "finish": choice.get("finish_reason"),
        "asked": asked,
        "answer": answer or ("calls " + ", ".join(calls) if calls else ""),
        "feedback": ", ".join(f"{v.get('key')}={_score(v)}" for v in trace["feedback"]),
        "latency_s": trace.get("latency_s"),
    }


def _score(verdict: dict) -> str:
    score = verdict.get("score")
    return "-" if score is None else f"{score:g}"


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""

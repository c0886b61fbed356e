"""From a trace's pieces (LLM calls, tool runs, verdicts) to training rows, for every platform.

A traced agent makes several LLM calls per trace, each sent the whole history so far; a call
whose conversation (request + answer) a later call of the same trace starts with is *folded*
into it, so one agent episode is one row and a trace of unrelated calls is one row per call.
A tool call the history does not answer is answered from the trace's tool runs (matched by
call id, else by tool name in order). Verdicts on one call go to the row holding that call;
verdicts on anything else in the trace (its root, a tool run, the trace itself) go to every
row of the trace.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from rlcli.data.trace_imports.shaping import message


@dataclass
class Call:
    """One LLM call: what it was sent and what it answered (None: no answer recorded)."""

    trace: str
    id: str
    order: tuple
    messages: list[dict]
    output: dict | None
    tools: list[dict] = field(default_factory=list)


@dataclass
class ToolRun:
    """One tool execution, as its own run/observation/span."""

    trace: str
    id: str
    order: tuple
    name: str | None
    call_id: str | None
    output: str


@dataclass
class Verdict:
    """A feedback entry for ``target`` (a run, observation or span id; None: the trace)."""

    trace: str | None
    target: str | None
    entry: dict


@dataclass
class Collected:
    """What a reader found in a file; ``owners`` maps every run id seen to its trace."""

    calls: list[Call] = field(default_factory=list)
    tool_runs: list[ToolRun] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    owners: dict[str, str] = field(default_factory=dict)
    unmapped: Counter = field(default_factory=Counter)

    def merge(self, line: Collected) -> None:
        """Take one line's findings: readers read a line into a fresh ``Collected`` and merge
        it only when the whole line was good, so a bad line leaves nothing behind."""
        self.calls += line.calls
        self.tool_runs += line.tool_runs
        self.verdicts += line.verdicts
        self.owners.update(line.owners)
        self.unmapped.update(line.unmapped)


def _arguments_key(arguments: str):
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except (json.JSONDecodeError, TypeError):
        return arguments


def _key(m: dict) -> tuple:
    """What makes two renderings of one message the same turn (ids and spacing aside)."""
    calls = tuple(
        (c["function"]["name"], _arguments_key(c["function"]["arguments"]))
        for c in m.get("tool_calls", ())
    )
    return (m["role"], m["content"].strip(), calls)


def _conversation(call: Call) -> list[dict]:
    return call.messages + ([call.output] if call.output else [])


def _extends(longer: list[dict], shorter: list[dict]) -> bool:
    return len(longer) >= len(shorter) and all(
        _key(a) == _key(b) for a, b in zip(longer, shorter, strict=False)
    )


def fold(calls: list[Call]) -> list[tuple[Call, list[Call]]]:
    """The calls no later call extends, each with the calls folded into it (time order)."""
    finals: list[tuple[Call, list[Call]]] = []
    for i, call in enumerate(calls):
        mine = _conversation(call)
        if not any(_extends(_conversation(later), mine) for later in calls[i + 1 :]):
            finals.append((call, []))
    for call in calls:
        for final, folded in finals:
            if call is not final and _extends(_conversation(final), _conversation(call)):
                folded.append(call)
                break
    return finals


def _answer_tool_calls(messages: list[dict], runs: list[ToolRun], used: set[str]) -> list[dict]:
    """``messages`` with each unanswered tool call followed by its tool run's output."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        out.append(m)
        if not m.get("tool_calls"):
            continue
        answered = set()
        for later in messages[i + 1 :]:
            if later["role"] != "tool":
                break
            answered.add(later.get("tool_call_id"))
        tail = messages[i + 1 :]
        n_tool = next((k for k, t in enumerate(tail) if t["role"] != "tool"), len(tail))
        replies = []
        for c in m["tool_calls"]:
            if c.get("id") in answered or (not c.get("id") and n_tool):
                continue
            run = _find_run(runs, used, c)
            if run is not None:
                used.add(run.id)
                replies.append(message("tool", run.output, call_id=c.get("id"), name=run.name))
        # keep the recorded replies first, then the ones taken from tool runs
        out.extend(tail[:n_tool])
        out.extend(replies)
        return out + _answer_tool_calls(tail[n_tool:], runs, used)
    return out


def _find_run(runs: list[ToolRun], used: set[str], call: dict) -> ToolRun | None:
    free = [r for r in runs if r.id not in used]
    if call.get("id"):
        for run in free:
            if run.call_id == call["id"]:
                return run
    return next((r for r in free if r.name == call["function"]["name"]), None)


def assemble(found: Collected) -> Iterator[tuple[dict, str, str]]:
    """Yield ``(row, trace id, call id)`` per conversation; what fits nowhere is counted in
    ``found.unmapped``."""
    calls: dict[str, list[Call]] = defaultdict(list)
    for call in found.calls:
        calls[call.trace].append(call)
    runs: dict[str, list[ToolRun]] = defaultdict(list)
    for run in sorted(found.tool_runs, key=lambda r: r.order):
        runs[run.trace].append(run)
    verdicts: dict[str, list[Verdict]] = defaultdict(list)
    for verdict in found.verdicts:
        trace = verdict.trace or found.owners.get(verdict.target or "")
        if trace in calls:
            verdicts[trace].append(verdict)
        else:
            found.unmapped["feedback on a trace with no LLM call in the input"] += 1
    for trace in set(runs) - set(calls):
        found.unmapped["tool run in a trace with no LLM call"] += len(runs[trace])
    for trace, trace_calls in calls.items():
        yield from _trace_rows(trace, sorted(trace_calls, key=lambda c: c.order), runs[trace],
                               verdicts[trace], found.unmapped)  # fmt: skip


def _trace_rows(trace, calls, runs, verdicts, unmapped) -> Iterator[tuple[dict, str, str]]:
    call_ids = {c.id for c in calls}
    used: set[str] = set()
    called: set[str] = set()
    for final, folded in fold(calls):
        if final.output is None:
            unmapped["LLM call with no answer recorded"] += 1
            continue
        messages = _answer_tool_calls(_conversation(final), runs, used)
        for m in messages:
            for c in m.get("tool_calls", ()):
                called.update((c.get("id"), c["function"]["name"]))
        mine = {final.id, *(c.id for c in folded)}
        row = {"messages": messages}
        tools = next((c.tools for c in (final, *reversed(folded)) if c.tools), None)
        if tools:
            row["tools"] = tools
        row["feedback"] = [
            v.entry for v in verdicts if v.target in mine or v.target not in call_ids
        ]
        yield row, trace, final.id
    called.discard(None)
    stray = [r for r in runs if r.id not in used and not ({r.call_id, r.name} & called)]
    if stray:
        unmapped["tool run matched to no tool call"] += len(stray)

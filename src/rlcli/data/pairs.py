"""Preference pairs for ``train dpo``, in TRL's three shapes, one per line:

- ``{"prompt": str, "chosen": str, "rejected": str}`` (the prompt is the user turn, the answers
  the assistant's),
- ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`` (conversational),
- ``{"chosen": [messages], "rejected": [messages]}`` (whole conversations: the messages they
  share from the start are the prompt, the rest the two completions),

and the cookbook's own rows (below), which is what the run folder keeps and a resume reads.

Each becomes the cookbook's ``LabeledComparison`` row (``{"comparison": {"prompt_conversation",
"completion_A", "completion_B"}, "label": "A"}``, chosen as A), the format its
``ComparisonBuilderFromJsonl`` reads. Every bad line is reported by number first.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlcli.data.chat import ROLES, content_text, read_jsonl


def _messages(value, field: str) -> tuple[list[dict] | None, str | None]:
    if not isinstance(value, list) or not value:
        return None, f'"{field}" is not a non-empty list of messages'
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return None, f'"{field}"[{i}]: not a message with a role ({", ".join(ROLES)})'
        text = content_text(message.get("content"))
        if text is None:
            return None, f'"{field}"[{i}]: content is not text'
        out.append({"role": message["role"], "content": text})
    return out, None


def to_comparison(row) -> tuple[dict | None, str | None]:
    """(the cookbook's labeled comparison row, None), or (None, why this line is not a pair)."""
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    if "comparison" in row:
        return _labeled(row)
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        keys = ", ".join(sorted(row)) or "none"
        return None, f'no "{missing[0]}" field (keys: {keys}); expected prompt, chosen, rejected'
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str) or isinstance(rejected, str):
        if not isinstance(prompt, str) or not prompt.strip():
            return None, '"prompt" is not a non-empty string (chosen/rejected are strings)'
        if not isinstance(chosen, str) or not isinstance(rejected, str):
            return None, '"chosen" and "rejected" are not both strings'
        if not chosen.strip() or not rejected.strip():
            return None, '"chosen" or "rejected" is empty'
        prompt_msgs = [{"role": "user", "content": prompt}]
        chosen_msgs = [{"role": "assistant", "content": chosen}]
        rejected_msgs = [{"role": "assistant", "content": rejected}]
    else:
        chosen_msgs, problem = _messages(chosen, "chosen")
        if problem:
            return None, problem
        rejected_msgs, problem = _messages(rejected, "rejected")
        if problem:
            return None, problem
        if prompt is None:  # implicit prompt: the shared start
            shared = 0
            while (
                shared < min(len(chosen_msgs), len(rejected_msgs)) - 1
                and chosen_msgs[shared] == rejected_msgs[shared]
            ):
                shared += 1
            prompt_msgs = chosen_msgs[:shared]
            chosen_msgs, rejected_msgs = chosen_msgs[shared:], rejected_msgs[shared:]
        elif isinstance(prompt, list):
            prompt_msgs, problem = _messages(prompt, "prompt")
            if problem:
                return None, problem
        else:
            return None, '"prompt" is not a string or a list of messages'
    if not prompt_msgs:
        return None, "no prompt (chosen and rejected share no first message)"
    for name, msgs in (("chosen", chosen_msgs), ("rejected", rejected_msgs)):
        if msgs[-1]["role"] != "assistant":
            return None, f'"{name}" does not end with an assistant message'
    if chosen_msgs == rejected_msgs:
        return None, '"chosen" and "rejected" are the same'
    comparison = {
        "prompt_conversation": prompt_msgs,
        "completion_A": chosen_msgs,
        "completion_B": rejected_msgs,
    }
    return {"comparison": comparison, "label": "A"}, None


def _labeled(row: dict) -> tuple[dict | None, str | None]:
    """The cookbook's own row (what the run folder keeps): checked, chosen made A."""
    comparison, label = row["comparison"], row.get("label")
    if label not in ("A", "B") or not isinstance(comparison, dict):
        return None, '"label" is not "A" or "B" (a tie teaches DPO nothing)'
    parts = {}
    for field in ("prompt_conversation", "completion_A", "completion_B"):
        parts[field], problem = _messages(comparison.get(field), f"comparison.{field}")
        if problem:
            return None, problem
    if label == "B":
        parts["completion_A"], parts["completion_B"] = parts["completion_B"], parts["completion_A"]
    return {"comparison": parts, "label": "A"}, None


def read_pairs(lines: Iterable[str], source: str) -> list[dict]:
    """Parse and validate preference JSONL; raise ``DataError`` listing every bad line."""
    return read_jsonl(lines, source, to_comparison, "preference pairs")

"""The one line of a log or a tool's output worth quoting in an error message."""

from __future__ import annotations

ERROR_WORDS = ("error", "exception", "failed")


def _lines(text: str | bytes) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return [line.strip() for line in text.splitlines() if line.strip()]


def last_line(text: str | bytes, limit: int = 300) -> str | None:
    """The last non-empty line (cut to ``limit``), or None."""
    lines = _lines(text)
    return lines[-1][:limit] if lines else None


def last_error_line(text: str | bytes, prefix: str = "", limit: int = 400) -> str | None:
    """With ``prefix`` (``rlcli-error: ``): the last line starting with it, prefix removed.
    Without: the last line naming an error (error, exception, failed). None if there is none."""
    lines = _lines(text)
    if prefix:
        hit = next((line for line in reversed(lines) if line.startswith(prefix)), None)
        return hit.removeprefix(prefix)[:limit] if hit else None
    for line in reversed(lines):
        if any(word in line.lower() for word in ERROR_WORDS):
            return line[:limit]
    return None

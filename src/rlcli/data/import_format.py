"""Which ``rlcli import`` format a file is in: every format tried on its first lines, the one
that keeps the most conversations (then the most assistant turns, what training learns) wins.

Why: a chat log read with the wrong ``-f`` is not an error line by line. An OpenAI dump read as
Anthropic parses, but finds no assistant turn and drops every row as "no assistant turn"; an
Anthropic dump read as OpenAI keeps rows but loses the system prompt and the final answer.
Only comparing formats shows it, so ``-f auto`` picks the best and a given ``-f`` that keeps
less than another format would is refused, naming the one that fits."""

from __future__ import annotations

from dataclasses import dataclass

from rlcli.errors import RlcliError

SAMPLE_LINES = 500  # enough for a trace's calls and runs to meet; cheap for every format
# Ties go to the simplest reading: ``messages`` and ``openai`` read a flat ``{"messages"}``
# file alike; a trace format keeps its origin and verdicts when it fits as well as a chat one.
PREFERENCE = ("messages", "langsmith", "langfuse", "otel", "openai", "anthropic", "sharegpt")


@dataclass(frozen=True, order=True)
class Fit:
    """How well one format reads the sample: conversations kept, their assistant turns (not all
    messages: formats differ in which tool turns they keep, not in what the model said), and
    (fewer is better) the lines it could not read."""

    kept: int
    answers: int
    unread: int

    def score(self) -> tuple[int, int, int]:
        return (self.kept, self.answers, -self.unread)

    def describe(self) -> str:
        return f"keeps {self.kept} conversations ({self.answers} assistant turns)"


def fits(sample: list[str], formats) -> dict[str, Fit]:
    """Each format's ``Fit`` on the sample (read as ``import_lines`` reads it)."""
    from rlcli.data.importers import ImportReport, import_lines  # one module below the other

    result = {}
    for fmt in formats:
        report = ImportReport()
        rows = list(import_lines(sample, fmt, min_messages=1, report=report))
        answers = sum(m["role"] == "assistant" for r in rows for m in r["messages"])
        result[fmt] = Fit(len(rows), answers, len(report.errors))
    return result


def choose(sample: list[str], fmt: str, name: str) -> tuple[str, str | None]:
    """(the format to read with, a line to say about the choice or None). ``fmt`` is what
    ``-f`` said; ``auto`` picks; another is refused, naming the better one, when a format
    keeps more of the sample than it does."""
    from rlcli.data.importers import ALL_FORMATS

    if not any(line.strip() for line in sample):
        return (PREFERENCE[0] if fmt == "auto" else fmt), None
    found = fits(sample, ALL_FORMATS)
    order = {f: i for i, f in enumerate(PREFERENCE)}
    best = max(found, key=lambda f: (found[f].score(), -order.get(f, len(order))))
    lines = sum(1 for line in sample if line.strip())
    where = f"the first {lines} lines" if lines >= SAMPLE_LINES else f"its {lines} lines"
    if fmt == "auto":
        if found[best].kept == 0:
            raise RlcliError(
                f"{name}: -f auto: no format finds a conversation with an assistant turn in "
                f"{where}; pass -f (one of {', '.join(ALL_FORMATS)})"
            )
        return best, f"{name}: format {best} (-f auto: it {found[best].describe()} of {where})"
    if found[fmt].score() < found[best].score():
        raise RlcliError(
            f"{name}: this does not look like -f {fmt}: of {where} it {found[fmt].describe()}, "
            f"-f {best} {found[best].describe()}; pass -f {best} (or -f auto)"
        )
    return fmt, None

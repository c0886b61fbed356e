"""Training rows that begin alike compute their common beginning once.

An RL batch is groups of answers to one prompt: 4 x 4 GSM8K rows are ~180 prompt tokens and
~180 answer tokens each, so half the tokens a forward_backward runs through the model are the
same prompt again. Causal attention makes a position's hidden state depend only on the tokens
up to it, so rows that share their first ``n`` tokens share those positions' hidden states
exactly, and where they also share the targets, their logprobs. The engine then runs each
group's shared part once (a prefix pass that keeps its keys and values), and every row's own
part after it, attending to its group's keys and values (``Engine._shared_logprobs``); the
backward sums each row's gradient into the shared part, as the plain pass does per row.

This module only plans: which rows form groups (``find_groups``) and how groups make
micro-batches within the token budget (``microbatches``, which packs every forward_backward:
without sharing, each row is a group of one)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Fewer shared positions than this are not worth a second decoder call.
MIN_SHARED = 32


@dataclass(frozen=True)
class Group:
    """Datum indices whose first ``shared`` positions have the same tokens and targets
    (``shared`` 0: a row on its own)."""

    rows: tuple[int, ...]
    shared: int


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading entries ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _shared_length(tokens: list[np.ndarray], targets: list[np.ndarray], i: int, j: int) -> int:
    """Leading positions rows ``i`` and ``j`` share, tokens and targets both, leaving each
    row at least one position of its own."""
    common = min(_common(tokens[i], tokens[j]), _common(targets[i], targets[j]))
    return min(common, len(tokens[i]) - 1, len(tokens[j]) - 1)


def find_groups(tokens: list[np.ndarray], targets: list[np.ndarray]) -> list[Group]:
    """Rows grouped by a shared beginning of at least ``MIN_SHARED`` positions.

    Rows are taken in lexicographic order of their tokens, where rows with a common beginning
    sit next to each other; a row joins the group before it while the group's shared length
    stays at least half of what it was (so a system prompt common to every row does not pull
    the answers to different questions into one group). ``targets`` (one per position) must
    match too: a shared position's logprob is then the same for every row."""
    order = sorted(range(len(tokens)), key=lambda i: tokens[i].astype(">i8").tobytes())
    groups: list[Group] = []
    rows: list[int] = []
    shared = 0
    for i in order:
        if rows:
            length = _shared_length(tokens, targets, rows[0], i)
            joined = length if len(rows) == 1 else min(shared, length)
            if joined >= MIN_SHARED and (len(rows) == 1 or 2 * joined >= shared):
                rows.append(i)
                shared = joined
                continue
            groups.append(Group(tuple(rows), shared if len(rows) > 1 else 0))
        rows, shared = [i], 0
    if rows:
        groups.append(Group(tuple(rows), shared if len(rows) > 1 else 0))
    return groups


def microbatches(groups: list[Group], lengths: list[int], budget: int) -> list[list[Group]]:
    """Groups packed into micro-batches whose padded size (the prefix pass's groups x longest
    shared part, plus the rows x longest own part) stays within ``budget`` tokens; a group too
    large for one is split into parts that each run the shared part again."""
    parts: list[Group] = []
    for group in groups:
        rows = sorted(group.rows, key=lambda i: lengths[i], reverse=True)
        own = lengths[rows[0]] - group.shared
        per = max(1, (budget - group.shared) // max(own, 1))
        for start in range(0, len(rows), per):
            chunk = tuple(rows[start : start + per])
            parts.append(Group(chunk, group.shared if len(chunk) > 1 else 0))
    parts.sort(key=lambda g: max(lengths[i] for i in g.rows) - g.shared, reverse=True)
    batches: list[list[Group]] = []
    for part in parts:
        if batches and _cost(batches[-1] + [part], lengths) <= budget:
            batches[-1].append(part)
        else:
            batches.append([part])
    return batches


def _cost(groups: list[Group], lengths: list[int]) -> int:
    shared = [g.shared for g in groups if g.shared]
    rows = [i for g in groups for i in g.rows]
    own = max(lengths[i] - g.shared for g in groups for i in g.rows)
    return len(shared) * max(shared, default=0) + len(rows) * own

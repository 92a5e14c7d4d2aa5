"""Answers that come back together came from one engine step: split a run's answer times where they are
further apart than :data:`GROUP_GAP_S`, and the groups show the steps' sizes as a client (or the server's
access log) sees them, e.g. a closed loop of 16 clients running as steps of 14 and 2 instead of 16
(``clef-bench --versus`` records them per time block)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

#: answers closer than this to the one before them belong to the same group (one engine step's)
GROUP_GAP_S = 0.015


def split_groups(times: Sequence[float], gap_s: float = GROUP_GAP_S) -> list[list[float]]:
    """``times`` (seconds, in order) split wherever more than ``gap_s`` separates two in a row."""
    out: list[list[float]] = []
    for t in times:
        if out and t - out[-1][-1] <= gap_s:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def size_histogram(groups: Sequence[Sequence[float]]) -> list[list[int]]:
    """``[[size, groups of that size], ...]`` by size."""
    return [[size, n] for size, n in sorted(Counter(len(g) for g in groups).items())]

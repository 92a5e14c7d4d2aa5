"""Where a request's wall time leaves the GPU idle, from a profiler's intervals (pure; no torch).

Given each request's host window (start, end) and the GPU kernels' (start, end), per request:

- ``lead``: from the request's start to its first kernel (the host's preparation before any GPU work);
- ``busy``: the union of its kernels' intervals (GPU time, overlaps counted once);
- ``gaps``: idle time between its first and last kernel (the GPU waited for the host mid-step);
- ``tail``: from its last kernel to the request's end (output handling after the GPU finished).

``lead + busy + gaps + tail`` is the window. A kernel belongs to the window it starts in.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Sequence

Interval = tuple[float, float]


def union_length(intervals: Iterable[Interval]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _own(window: Interval, kernels: Sequence[Interval]) -> tuple[list[Interval], float, float]:
    """The kernels that start in ``window``, and the start of the first and the end of the last."""
    s, e = window
    mine = [k for k in kernels if s <= k[0] < e]
    if not mine:
        return mine, e, e
    return mine, min(k[0] for k in mine), max(k[1] for k in mine)


def split_window(window: Interval, kernels: Sequence[Interval]) -> dict[str, float]:
    s, e = window
    mine, first, last = _own(window, kernels)
    if not mine:
        return {"lead": e - s, "busy": 0.0, "gaps": 0.0, "tail": 0.0, "kernels": 0}
    busy = union_length(mine)
    return {"lead": first - s, "busy": busy, "gaps": (last - first) - busy, "tail": max(e - last, 0.0),
            "kernels": len(mine)}


def timeline(windows: Sequence[Interval], kernels: Sequence[Interval], scale: float = 1e-3) -> dict[str, float]:
    """Median of each part over the windows, times ``scale`` (profiler microseconds -> ms by default)."""
    parts = [split_window(w, kernels) for w in windows]
    if not parts:
        return {}
    out = {f"{k}_ms": round(statistics.median(p[k] for p in parts) * scale, 2) for k in ("lead", "busy", "gaps", "tail")}
    out["kernels"] = statistics.median(p["kernels"] for p in parts)
    return out


def _clip(intervals: Iterable[Interval], spans: Sequence[Interval]) -> list[Interval]:
    return [(max(s, a), min(e, b)) for s, e in intervals for a, b in spans if max(s, a) < min(e, b)]


def phase_split(window: Interval, kernels: Sequence[Interval], phases: dict[str, Sequence[Interval]]) -> dict:
    """Per phase (name -> its GPU-side ranges, e.g. a profiler range's projection onto the GPU): how
    long the GPU spent inside the phase's ranges within ``window`` (``span``), busy with kernels there
    (``busy``), and idle there (``idle``); ``other`` is the rest of the request's first-to-last-kernel
    span. Phases are assumed not to overlap one another."""
    mine, first, last = _own(window, kernels)
    out: dict[str, dict[str, float]] = {}
    if not mine:
        return out
    taken_span = taken_busy = 0.0
    for name, ranges in phases.items():
        spans = _clip(ranges, [(first, last)])
        span, busy = union_length(spans), union_length(_clip(mine, spans))
        out[name] = {"span": span, "busy": busy, "idle": span - busy}
        taken_span, taken_busy = taken_span + span, taken_busy + busy
    busy_all = union_length(mine)
    out["other"] = {"span": (last - first) - taken_span, "busy": busy_all - taken_busy,
                    "idle": (last - first) - taken_span - (busy_all - taken_busy)}
    return out


def phase_timeline(windows: Sequence[Interval], kernels: Sequence[Interval], phases: dict[str, Sequence[Interval]],
                   scale: float = 1e-3) -> dict[str, dict[str, float]]:
    """Median over the windows of each phase's span / busy / idle (ms by default)."""
    parts = [phase_split(w, kernels, phases) for w in windows]
    parts = [p for p in parts if p]
    if not parts:
        return {}
    return {name: {f"{k}_ms": round(statistics.median(p[name][k] for p in parts) * scale, 2)
                   for k in ("span", "busy", "idle")} for name in parts[0]}

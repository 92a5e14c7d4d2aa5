"""Paired A/B runs: two servers answer the same requests, one at a time, in alternating order.

Why: on the shared GPU machines one short decision is host-bound, and the host's speed is a
lottery. Each vCPU ran Python at ~37 or ~70 ns per loop step, and which ones were fast changed
within seconds (``bench/host_speed.py``; ``docs/latency.md``, "The host's speed varies"). Two
servers measured one after the other can land in different phases of that lottery, so their
single-run p50s differed by 15-25 % with identical work (cache on vs off, FP8 vs BF16). Run side
by side on one GPU and interleaved request by request (A B, B A, A B, ...), both sample the same
stretch of time, and the comparison is between the servers, not between their minutes.

``clef-bench URL_A --versus URL_B ...`` runs this at concurrency 1. Each generated request goes to
both servers. The result: per server the p50 and the Server-Timing stages, and ``ratio``, B's p50
over A's, with its spread across consecutive blocks of pairs (one ratio per block).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from .loadgen import Outcome, percentile, stage_medians
from .workloads import BenchRequest

#: consecutive pairs per block: a block is one short stretch of time, and its ratio one sample
DEFAULT_BLOCK = 20


def pair_order(i: int) -> tuple[int, int]:
    """Which server answers pair ``i`` first: A then B for even ``i``, B then A for odd ``i``, so
    neither is always the one that runs right after the other (warm caches, a busy client)."""
    return (0, 1) if i % 2 == 0 else (1, 0)


def _ratio(b: Sequence[float], a: Sequence[float]) -> float | None:
    pa, pb = percentile(a, 50), percentile(b, 50)
    return None if not pa or pb is None else pb / pa


def paired_summary(a_s: Sequence[float | None], b_s: Sequence[float | None], block: int = DEFAULT_BLOCK) -> dict:
    """Latencies (s) of the same requests on A and B (``None``: not answered) -> the comparison.

    Only pairs both servers answered count. ``ratio`` is B's p50 over A's over every pair;
    ``block_ratios`` the same per block of ``block`` consecutive pairs (a shorter last block is
    folded into the one before), ``b_slower_blocks`` how many of them exceed 1.
    """
    if block < 1:
        raise ValueError("block must be >= 1")
    pairs = [(a, b) for a, b in zip(a_s, b_s) if a is not None and b is not None]
    a_ok, b_ok = [p[0] for p in pairs], [p[1] for p in pairs]
    blocks = [pairs[i:i + block] for i in range(0, len(pairs), block)]
    if len(blocks) > 1 and len(blocks[-1]) < block:
        last = blocks.pop()
        blocks[-1] = blocks[-1] + last
    ratios = [r for r in (_ratio([b for _, b in blk], [a for a, _ in blk]) for blk in blocks) if r is not None]
    ms = 1000.0
    return {
        "pairs": len(pairs),
        "unpaired": len(a_s) - len(pairs),
        "a_p50_ms": None if not a_ok else round(percentile(a_ok, 50) * ms, 3),
        "b_p50_ms": None if not b_ok else round(percentile(b_ok, 50) * ms, 3),
        "ratio": None if not pairs else round(_ratio(b_ok, a_ok), 4),
        "block": block,
        "block_ratios": [round(r, 4) for r in ratios],
        "b_slower_blocks": sum(r > 1 for r in ratios),
    }


async def run_pairs(requests: Sequence[BenchRequest], send_a: Callable[[BenchRequest], Any],
                    send_b: Callable[[BenchRequest], Any], *, time_limit: float | None = None,
                    on_done: Callable[[int], None] | None = None) -> tuple[list[Outcome], list[Outcome]]:
    """Send every request to both servers, one at a time, in :func:`pair_order`; no new pair starts
    after ``time_limit`` seconds."""
    out: tuple[list[Outcome], list[Outcome]] = ([], [])
    sends = (send_a, send_b)
    t0 = time.perf_counter()
    for i, req in enumerate(requests):
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
        for side in pair_order(i):
            out[side].append(await sends[side](req))
        if on_done is not None:
            on_done(1)
    return out


def summarize_variant(name: str, a: Sequence[Outcome], b: Sequence[Outcome], block: int = DEFAULT_BLOCK) -> dict:
    """One variant's paired result: the comparison, and per server its statuses and stage medians."""
    def lat(outs):
        return [o.latency_s if o.ok else None for o in outs]

    def side(outs):
        statuses: dict[str, int] = {}
        for o in outs:
            statuses[o.status] = statuses.get(o.status, 0) + 1
        return {"statuses": statuses,
                "server_stages_p50_ms": stage_medians([o.server_stages for o in outs if o.ok and o.server_stages])}

    la, lb = lat(a), lat(b)
    return {"variant": name, "requests": len(a), **paired_summary(la, lb, block),
            "a": side(a), "b": side(b),
            # every pair in order (ms; null: not answered), for other statistics than the blocks'
            "latency_ms": {"a": [None if x is None else round(x * 1000, 3) for x in la],
                           "b": [None if x is None else round(x * 1000, 3) for x in lb]}}


def paired_table(results: dict) -> str:
    """The text table of a paired run."""
    a, b = results["target"]["a"], results["target"]["b"]
    lines = [f"clef-bench paired, c=1, same requests in alternating order:  A = {a}   B = {b}",
             f"{'variant':<14} {'pairs':>5} {'A p50 ms':>9} {'B p50 ms':>9} {'B/A':>7}  blocks B/A (min-max, B slower)"]
    for v in results["variants"]:
        r = v["block_ratios"]
        spread = f"{min(r):.3f}-{max(r):.3f}, {v['b_slower_blocks']}/{len(r)}" if r else "-"
        ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
        a_ms = "-" if v["a_p50_ms"] is None else f"{v['a_p50_ms']:.1f}"
        b_ms = "-" if v["b_p50_ms"] is None else f"{v['b_p50_ms']:.1f}"
        lines.append(f"{v['variant']:<14} {v['pairs']:>5} {a_ms:>9} {b_ms:>9} {ratio:>7}  {spread}")
    lines.append("engine stage p50 ms (Server-Timing): " + ", ".join(
        f"{v['variant']} A {v['a']['server_stages_p50_ms'].get('engine', '-')} / "
        f"B {v['b']['server_stages_p50_ms'].get('engine', '-')}" for v in results["variants"]))
    return "\n".join(lines)

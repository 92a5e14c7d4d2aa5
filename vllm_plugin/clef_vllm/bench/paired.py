"""Paired A/B runs: two servers answer the same requests, one at a time, in alternating order.

Why: on the shared GPU machines one short decision is host-bound, and the host's speed is a
lottery. Each vCPU ran Python at ~37 or ~70 ns per loop step, and which ones were fast changed
within seconds (``bench/results/h200_host_speed*.json``; ``docs/latency.md``, "The host's speed varies"). Two
servers measured one after the other can land in different phases of that lottery, so their
single-run p50s differed by 15-25 % with identical work (cache on vs off, FP8 vs BF16). Run side
by side on one GPU and interleaved request by request (A B, B A, A B, ...), both sample the same
stretch of time, and the comparison is between the servers, not between their minutes.

``clef-bench URL_A --versus URL_B ...`` runs this at concurrency 1. Each generated request goes to
both servers. The result: per server the p50 and the Server-Timing stages, and ``ratio``, B's p50
over A's, with its spread across consecutive blocks of pairs (one ratio per block).

At a concurrency above 1 a request cannot be sent to both servers at once without them sharing the
GPU, so the servers take turns in short time blocks instead (A B B A A B B A ...: a linear drift
cancels), each block a closed loop of ``c`` clients on fresh requests. ``ratio`` is then B's
throughput over A's, the median over consecutive (A, B) block pairs, with each pair's ratio.

A block's throughput over its wall time counts its edges: it starts from an engine the other server's
block left idle (``c`` requests arrive at once), and it ends with a drain, from the last request started
until the last answer (up to a whole request's latency, by where in the step cycle the block's end
falls). At c=64 on the H200 the drain moves a 5-second block's wall time by 0.3-0.7 s
(``bench/results/clef_bench/h200_9b_paired_grid_vs_raw_c16-64.json``). So each block also gives its steady
throughput by Little's law: with ``c`` requests always in flight, throughput is ``c`` over their mean latency
(``steady_req_per_s``, over the requests started after :data:`STEADY_FROM` of the block); ``steady_ratio``
compares those per pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections import Counter
from typing import Any, Callable, Sequence

from .cohorts import size_histogram, split_groups
from .loadgen import Outcome, closed_loop, percentile, stage_medians
from .workloads import BenchRequest
from clef_vllm.server.loop_lag import STALL_S, watch_loop_lag

#: consecutive pairs per block: a block is one short stretch of time, and its ratio one sample
DEFAULT_BLOCK = 20
#: c > 1: which server runs time block k (A B B A, repeated)
BLOCK_ORDER = (0, 1, 1, 0)
#: c > 1: a block's steady throughput (Little's law) counts the requests started after this share of it
STEADY_FROM = 0.2


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


def block_side(k: int) -> int:
    """The server (0: A, 1: B) that runs time block ``k`` at c > 1."""
    return BLOCK_ORDER[k % len(BLOCK_ORDER)]


async def run_blocks(pool: Sequence[BenchRequest], concurrency: int, send_a: Callable[[BenchRequest], Any],
                     send_b: Callable[[BenchRequest], Any], *, blocks: int, block_s: float,
                     on_done: Callable[[int], None] | None = None) -> tuple[list[dict], bool]:
    """c > 1: ``blocks`` closed-loop blocks of ``block_s`` seconds, alternating servers (:func:`block_side`),
    each on the next unused requests of ``pool``. Returns each block's numbers and whether the pool ran
    out and requests were sent again (a state cache would then see repeats)."""
    sends = (send_a, send_b)
    out, cursor = [], 0
    for k in range(blocks):
        side = block_side(k)
        reqs = [pool[(cursor + i) % len(pool)] for i in range(len(pool))]
        t0, started_unix = time.perf_counter(), time.time()

        async def timed(req, send=sends[side], t0=t0):
            started = time.perf_counter() - t0
            return started, await send(req)

        # the clients' own loop: a late timer here holds every client (and an in-process raw engine's output
        # handling), whichever server the block is on
        lags: list[tuple[float, float]] = []
        watcher = asyncio.get_running_loop().create_task(watch_loop_lag(
            lambda lag, t0=t0, lags=lags: lags.append((time.perf_counter() - t0, lag)), lambda: True, "client",
            stall_s=math.inf))
        try:
            results, wall = await closed_loop(reqs, concurrency, timed, time_limit=block_s)
        finally:
            watcher.cancel()                     # on this loop: it stops at once
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        done = [r for r in results if r is not None]
        cursor += len(done)
        ok = [o.latency_s for _, o in done if o.ok]
        steady = [o.latency_s for started, o in done if o.ok and started >= STEADY_FROM * block_s]
        statuses = dict(Counter(o.status for _, o in done))
        answered = split_groups(sorted(started + o.latency_s for started, o in done if o.ok))
        out.append({"side": "ab"[side], "sent": len(done), "ok": len(ok), "wall_s": round(wall, 4),
                    "req_per_s": round(len(ok) / max(wall, 1e-9), 4),
                    "steady_req_per_s": round(concurrency / statistics.mean(steady), 4) if steady else None,
                    "p50_ms": None if not ok else round(percentile(ok, 50) * 1000, 3), "statuses": statuses,
                    # the answers as they came back, in groups (one engine step's each): the clients' cohorts
                    "answer_groups": size_histogram(answered),
                    "answers_per_group": round(len(ok) / len(answered), 2) if answered else None,
                    # when the block started (to hold against a server's log) and how late the clients' loop ran
                    # its timers: the worst, and each one STALL_S late or more as (seconds into the block, ms)
                    "started_unix": round(started_unix, 3),
                    "client_loop_lag_max_ms": round(max((lag for _, lag in lags), default=0.0) * 1000, 1),
                    "client_loop_stalls": [[round(at, 3), round(lag * 1000, 1)] for at, lag in lags if lag >= STALL_S]})
        if on_done is not None:
            on_done(1)
    return out, cursor > len(pool)


def _median_of(blocks: Sequence[dict], key: str) -> float | None:
    """The median of ``key`` over the blocks that have it (None: none has)."""
    values = [blk[key] for blk in blocks if blk.get(key) is not None]
    return statistics.median(values) if values else None


def blocks_summary(blocks: Sequence[dict]) -> dict:
    """The comparison of a block run: per server the median throughput and p50 over its blocks, and per
    consecutive (A, B) block pair B's throughput over A's (``pair_ratios``; ``ratio`` their median) and
    B's p50 over A's (``p50_ratio``, the median)."""
    med = statistics.median
    a = [blk for blk in blocks if blk["side"] == "a"]
    b = [blk for blk in blocks if blk["side"] == "b"]
    pairs = [(x, y) if x["side"] == "a" else (y, x) for x, y in zip(blocks[::2], blocks[1::2]) if x["side"] != y["side"]]
    tput = [pb["req_per_s"] / pa["req_per_s"] for pa, pb in pairs if pa["req_per_s"] > 0]
    steady = [pb["steady_req_per_s"] / pa["steady_req_per_s"] for pa, pb in pairs
              if pa.get("steady_req_per_s") and pb.get("steady_req_per_s")]
    lat = [pb["p50_ms"] / pa["p50_ms"] for pa, pb in pairs if pa["p50_ms"] and pb["p50_ms"]]
    return {
        "a_req_per_s": None if not a else round(med(blk["req_per_s"] for blk in a), 3),
        "b_req_per_s": None if not b else round(med(blk["req_per_s"] for blk in b), 3),
        "ratio": None if not tput else round(med(tput), 4),
        "pair_ratios": [round(r, 4) for r in tput],
        "b_faster_pairs": sum(r > 1 for r in tput),
        "p50_ratio": None if not lat else round(med(lat), 4),
        "steady_ratio": None if not steady else round(med(steady), 4),
        "steady_pair_ratios": [round(r, 4) for r in steady],
        "unanswered": sum(blk["sent"] - blk["ok"] for blk in blocks),
        # per server, the median over its blocks of the answers per group (None in files written before)
        "answers_per_group": {name: _median_of(sides, "answers_per_group") for name, sides in (("a", a), ("b", b))},
    }


def summarize_variant(name: str, a: Sequence[Outcome], b: Sequence[Outcome], block: int = DEFAULT_BLOCK) -> dict:
    """One variant's paired result: the comparison, and per server its statuses and stage medians."""
    def lat(outs):
        return [o.latency_s if o.ok else None for o in outs]

    def side(outs):
        return {"statuses": dict(Counter(o.status for o in outs)),
                "server_stages_p50_ms": stage_medians([o.server_stages for o in outs if o.ok and o.server_stages])}

    la, lb = lat(a), lat(b)
    return {"variant": name, "concurrency": 1, "requests": len(a), **paired_summary(la, lb, block),
            "a": side(a), "b": side(b),
            # every pair in order (ms; null: not answered), for other statistics than the blocks'
            "latency_ms": {"a": [None if x is None else round(x * 1000, 3) for x in la],
                           "b": [None if x is None else round(x * 1000, 3) for x in lb]}}


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _spread(ratios: Sequence[float], count: int) -> str:
    """``min-max, count/len`` of a list of ratios (``-`` when empty)."""
    return f"{min(ratios):.3f}-{max(ratios):.3f}, {count}/{len(ratios)}" if ratios else "-"


def _steady_spread(v: dict) -> str:
    """A block run's steady pair ratios as ``min-max, B faster/pairs`` (``-``: none, as in files written
    before they were counted)."""
    ratios = v.get("steady_pair_ratios") or []
    return _spread(ratios, sum(r > 1 for r in ratios))


def _groups(v: dict) -> str:
    """A block run's answers per group, A and B (``-``: not recorded)."""
    per = v.get("answers_per_group") or {}
    return f"{_num(per.get('a'), '.1f')} {_num(per.get('b'), '.1f')}"


def paired_table(results: dict) -> str:
    """The text table of a paired run."""
    a, b = results["target"]["a"], results["target"]["b"]
    single = [v for v in results["variants"] if v.get("concurrency", 1) == 1]
    several = [v for v in results["variants"] if v.get("concurrency", 1) > 1]
    lines = [f"clef-bench paired:  A = {a}   B = {b}"]
    if single:
        lines += ["c=1, the same requests in alternating order; B/A = B's p50 over A's",
                  f"{'variant':<14} {'pairs':>5} {'A p50 ms':>9} {'B p50 ms':>9} {'B/A':>7}  "
                  "blocks B/A (min-max, B slower)"]
        lines += [f"{v['variant']:<14} {v['pairs']:>5} {_num(v['a_p50_ms'], '.1f'):>9} {_num(v['b_p50_ms'], '.1f'):>9} "
                  f"{_num(v['ratio'], '.3f'):>7}  {_spread(v['block_ratios'], v['b_slower_blocks'])}" for v in single]
        lines.append("engine stage p50 ms (Server-Timing): " + ", ".join(
            f"{v['variant']} A {v['a']['server_stages_p50_ms'].get('engine', '-')} / "
            f"B {v['b']['server_stages_p50_ms'].get('engine', '-')}" for v in single))
    if several:
        lines += ["c>1, the servers in turns (time blocks A B B A ...); B/A = B's req/s over A's, per (A, B) pair",
                  f"{'variant':<14} {'c':>3} {'blocks':>6} {'A req/s':>8} {'B req/s':>8} {'B/A':>7}  "
                  "pairs B/A (min-max, B faster)  p50 B/A  steady B/A (pairs)  answers/group A B"]
        lines += [f"{v['variant']:<14} {v['concurrency']:>3} {len(v['blocks']):>6} {_num(v['a_req_per_s'], '.1f'):>8} "
                  f"{_num(v['b_req_per_s'], '.1f'):>8} {_num(v['ratio'], '.3f'):>7}  "
                  f"{_spread(v['pair_ratios'], v['b_faster_pairs']):<28} {_num(v['p50_ratio'], '.3f'):>7}  "
                  f"{_num(v.get('steady_ratio'), '.3f')} ({_steady_spread(v)})  {_groups(v)}"
                  + ("  (pool wrapped: requests repeated)" if v["wrapped"] else "") + _client_stalls(v)
                  for v in several]
    return "\n".join(lines)


def _client_stalls(variant: dict) -> str:
    """``"  (clients' loop held >= 100 ms: A 1, B 0)"`` when a block's clients were held (their own loop ran a
    timer that late: every client of that block waited, whichever server it was on), else nothing."""
    held = {side: sum(len(blk.get("client_loop_stalls") or ()) for blk in variant["blocks"] if blk["side"] == side)
            for side in "ab"}
    if not any(held.values()):
        return ""
    return f"  (clients' loop held >= {STALL_S * 1000:.0f} ms: A {held['a']}, B {held['b']})"

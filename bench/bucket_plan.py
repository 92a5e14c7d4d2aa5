"""Plan the prefill-graph buckets from a sweep: pad each length to the bucket that costs the least time.

A single-sequence prefill step runs padded to a bucket (``--prefill-graph-buckets``). The backbone's GEMMs
are not proportional to the rows (``bench/gemm_sizes.py``; ``bench/results/h200_gemm_sizes_{bf16,fp8}.json``):
on the H200 vLLM's cutlass FP8 kernel takes 7.78 ms at 448 rows and 7.12 at 480, cuBLAS BF16 9.20 ms at 400
and 10.52 at 448. So padding further can be cheaper, and a bucket at a cheap size can save more than the
padding costs. This script models a step's GPU time at ``b`` padded tokens as

    scale * gemm(b) + other_us * b / 1000          (milliseconds)

(``scale``: the GEMMs' time inside the step graph over the sweep's, ``other_us``: the rest of the step's GPU
time per padded token; both from a profiled step, ``--profiled TOKENS:GEMM_MS:BUSY_MS``). A step sweep from
``bench/latency.py --sweep LO:HI:STEP`` (one request of exactly each size, a bucket at each, any checkpoint's
kernels) needs no model: its p50s are the costs. Either way the plan keeps every
swept size that is cheaper than every larger one: then each length's cheapest bucket at or above it is in
the set. Sizes below and above the sweep keep the generic buckets (``DEFAULT_BUCKETS``; the server's defaults
per linear kernel, ``LINEAR_BUCKETS``, came from this script's plans, measured in pairs).

    python3 bench/bucket_plan.py bench/results/h200_gemm_sizes_fp8.json --profiled 448:6.3:12.1 [--lengths 300:700]
        [--keep N]        # at most N buckets inside the sweep's range, dropped greedily by the mean cost
    python3 bench/bucket_plan.py LATENCY_SWEEP.json [--lengths LO:HI] [--keep N]
    python3 bench/bucket_plan.py --differs N,N,... --linear fp8 --lengths LO:HI   # exit 0 if the list pads some
                                  # length differently from the server's default for that linear kernel, else 1

Prints the planned ``--prefill-graph-buckets`` value and, per length class, the step time (modelled or
measured) with the generic buckets and with the plan. Either way a plan, not a result: pair it against the
default on the GPU (``bench/paired.sh``) before trusting it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS, choose_bucket, default_buckets


def step_costs(rows: list[dict], scale: float, other_us: float) -> dict[int, float]:
    """Modelled GPU ms of a step padded to each swept token count."""
    return {int(r["tokens"]): scale * float(r["backbone_gemm_ms"]) + other_us * int(r["tokens"]) / 1000.0
            for r in rows}


def measured_costs(data: dict) -> dict[int, float] | None:
    """The step costs of ``bench/latency.py --sweep``'s output (its first result with a sweep: one request of
    exactly each size, p50 ms), or ``None`` for another file (a GEMM sweep)."""
    for result in data.get("results", []):
        if result.get("sweep"):
            return {int(r["tokens"]): float(r["p50_ms"]) for r in result["sweep"]}
    return None


def plan(costs: dict[int, float], defaults: tuple[int, ...] = DEFAULT_BUCKETS) -> list[int]:
    """The generic buckets outside the swept range, and inside it every size cheaper than all larger swept
    sizes (so a length's cheapest swept bucket at or above it is always kept). The largest swept size is
    always kept: lengths up to it must still find a bucket in the range."""
    lo, hi = min(costs), max(costs)
    kept, best = [], float("inf")
    for size in sorted(costs, reverse=True):
        if costs[size] < best:
            kept.append(size)
            best = costs[size]
    return sorted(set(kept) | {b for b in defaults if b < lo or b > hi})


def mean_cost(buckets: list[int], costs: dict[int, float], lengths: range) -> float:
    """Mean modelled ms of a step over ``lengths`` (each padded to its bucket in ``buckets``)."""
    got = [costs[b] for b in (choose_bucket(n, buckets) for n in lengths) if b in costs]
    return sum(got) / max(len(got), 1)


def prune(buckets: list[int], costs: dict[int, float], keep: int, lengths: range) -> list[int]:
    """``buckets`` with at most ``keep`` swept sizes: repeatedly drop the swept size whose loss raises the
    mean modelled cost over ``lengths`` least (the largest swept size stays: it holds the range's top)."""
    out = list(buckets)
    top = max(costs)
    while sum(b in costs for b in out) > keep:
        drops = [b for b in out if b in costs and b != top]
        if not drops:
            break
        out.remove(min(drops, key=lambda b: mean_cost([x for x in out if x != b], costs, lengths)))
    return out


def modelled(n: int, buckets: list[int], costs: dict[int, float]) -> tuple[int | None, float | None]:
    """The bucket a length-``n`` step pads to and its modelled ms (``None``: outside the sweep)."""
    b = choose_bucket(n, buckets)
    return b, costs.get(b) if b is not None else None


def differs(buckets: list[int], linear: str | None, lengths: range) -> list[tuple[int, int | None, int | None]]:
    """The lengths that ``buckets`` pads to another bucket than the server's default for ``linear`` does:
    (length, default bucket, this list's bucket)."""
    default = default_buckets(linear)
    return [(n, choose_bucket(n, default), choose_bucket(n, buckets)) for n in lengths
            if choose_bucket(n, default) != choose_bucket(n, buckets)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", nargs="?", help="bench/gemm_sizes.py's JSON (a model: needs --profiled) or "
                                             "bench/latency.py --sweep's (measured step costs)")
    ap.add_argument("--differs", default=None, metavar="N,N,...",
                    help="instead of planning: exit 0 if this bucket list pads some of --lengths to another bucket "
                         "than the server's default for --linear, 1 if it pads them all alike")
    ap.add_argument("--linear", default=None, help="with --differs: the linear kernel (fp8; default BF16)")
    ap.add_argument("--profiled", default=None, metavar="TOKENS:GEMM_MS:BUSY_MS",
                    help="with a GEMM sweep: one profiled step of the same dtype: its padded tokens, its GEMMs' ms, "
                         "its GPU busy ms")
    ap.add_argument("--lengths", default=None, metavar="LO:HI",
                    help="the lengths to tabulate and to prune for (default: the sweep's range), every 16 tokens")
    ap.add_argument("--keep", type=int, default=None, metavar="N",
                    help="keep at most N buckets inside the sweep's range (fewer graphs to capture at start)")
    args = ap.parse_args(argv)
    if args.differs is not None:
        if not args.lengths:
            ap.error("--differs needs --lengths LO:HI")
        lo, hi = (int(x) for x in args.lengths.split(":"))
        try:
            buckets = sorted(int(b) for b in args.differs.split(","))
        except ValueError:
            ap.error(f"--differs: expected token counts separated by commas, got {args.differs!r}")
        rows = differs(buckets, args.linear, range(lo, hi + 1))
        runs: list[list] = []                 # consecutive lengths padded alike: [first, last, default, this list]
        for n, old_b, new_b in rows:
            if runs and runs[-1][1] == n - 1 and runs[-1][2:] == [old_b, new_b]:
                runs[-1][1] = n
            else:
                runs.append([n, n, old_b, new_b])
        for first, last, old_b, new_b in runs:
            print(f"{first}-{last} tokens: the default pads to {old_b}, this list to {new_b}")
        if not rows:
            print(f"{lo}-{hi} tokens pad to the same buckets as the default")
        return 0 if rows else 1
    if args.sweep is None:
        ap.error("a sweep file is needed (or --differs)")
    data = json.loads(Path(args.sweep).read_text())
    measured = measured_costs(data)
    if measured is None and "results" in data:
        ap.error(f"{args.sweep}: bench/latency.py's file without a sweep result (did its run fail? its results: "
                 f"{[r.get('error', 'no sweep') for r in data['results']]})")
    if measured is not None:
        if args.profiled:
            ap.error("--profiled is for a GEMM sweep; this file holds measured step costs")
        costs = measured
        print(f"measured: one request of each swept size, p50 ms ({len(costs)} sizes)")
    else:
        if not args.profiled:
            ap.error("a GEMM sweep needs --profiled TOKENS:GEMM_MS:BUSY_MS (a model of the step)")
        rows = data["rows"]
        tokens, gemm_ms, busy_ms = (float(x) for x in args.profiled.split(":"))
        swept = {int(r["tokens"]): float(r["backbone_gemm_ms"]) for r in rows}
        if int(tokens) not in swept:
            ap.error(f"--profiled: {int(tokens)} tokens is not a swept size")
        scale = gemm_ms / swept[int(tokens)]
        other_us = (busy_ms - gemm_ms) / tokens * 1000.0
        costs = step_costs(rows, scale, other_us)
        print(f"model: {scale:.3f} x the sweep's GEMM ms + {other_us:.1f} us per padded token (from {args.profiled})")
    lo, hi = (int(x) for x in args.lengths.split(":")) if args.lengths else (min(costs) - 15, max(costs))
    planned = plan(costs)
    if args.keep is not None:
        planned = prune(planned, costs, args.keep, range(lo, hi + 1))
    print("--prefill-graph-buckets " + ",".join(str(b) for b in planned))
    print(f"{'length':>6}  {'generic':>7} {'ms':>6}  {'planned':>7} {'ms':>6}  {'saved ms':>8}")
    saved = []
    for n in range(lo, hi + 1, 16):
        b0, c0 = modelled(n, list(DEFAULT_BUCKETS), costs)
        b1, c1 = modelled(n, planned, costs)
        if c0 is None or c1 is None:
            continue
        saved.append(c0 - c1)
        print(f"{n:>6}  {b0:>7} {c0:>6.2f}  {b1:>7} {c1:>6.2f}  {c0 - c1:>8.2f}")
    if saved:
        print(f"mean modelled saving over these lengths: {sum(saved) / len(saved):.2f} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())

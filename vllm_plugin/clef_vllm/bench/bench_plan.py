"""What ``clef-bench`` runs: the variants of the chosen workloads (or a request file), each with its concurrencies,
the requests measured at each point and the warm-up requests.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

from clef_vllm.bench.workloads import WARM_START, WORKLOADS, BenchRequest, RequestFactory, Variant, build_variants
from clef_vllm.schema.records import load_request_file

LONG_REQUEST_TOKENS = 2048


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_concurrency(items: list[str]) -> tuple[list[int], dict[str, list[int]]]:
    """``["1,4,16", "long=1,4", "fanout-64q=1"]`` -> (default list, overrides by workload or variant name)."""
    default: list[int] | None = None
    overrides: dict[str, list[int]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if sep:
            overrides[name.strip()] = int_list(values)
        else:
            default = int_list(item)
    return default or [1, 4, 16, 64], overrides


def requests_for(c: int, sample_tokens: int | None, fixed: int | None) -> int:
    if fixed is not None:
        return fixed
    if sample_tokens is not None and sample_tokens > LONG_REQUEST_TOKENS:
        return max(8, 2 * c)
    return max(16, 4 * c)


class PlanItem:
    """One variant: its concurrencies, the measured pool and the warm-up requests."""

    def __init__(self, variant: Variant | None, name: str, concurrencies: list[int], pool: list[BenchRequest],
                 warm: list[BenchRequest], counts: dict[int, int], offsets: dict[int, int] | None = None):
        self.variant = variant
        self.name = name
        self.concurrencies = concurrencies
        self.pool = pool
        self.warm = warm
        self.counts = counts
        self.offsets = offsets or {}   # --unique-per-point: where each point's own requests start in the pool

    def point_requests(self, c: int) -> list[BenchRequest]:
        start = self.offsets.get(c, 0)
        return self.pool[start: start + self.counts[c]]

    def describe(self) -> dict:
        d = self.variant.describe() if self.variant else {"name": self.name, "workload": "file"}
        expected = [r.expected_tokens for r in self.pool if r.expected_tokens is not None]
        d["concurrency"] = self.concurrencies
        d["requests_per_point"] = {str(c): n for c, n in self.counts.items()}
        if expected:
            d["expected_tokens"] = {"min": min(expected), "mean": round(sum(expected) / len(expected), 1),
                                    "max": max(expected)}
        return d


def make_plan(args, factory: RequestFactory | None, log: Callable[[str], None]) -> list[PlanItem]:
    default_c, overrides = parse_concurrency(args.concurrency)
    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    if names == ["all"]:
        names = list(WORKLOADS)
    if names == ["none"]:
        names = []
    plan: list[PlanItem] = []
    if names:
        if factory is None:
            raise SystemExit("clef-bench: generated workloads need --tokenizer DIR (the checkpoint folder)")
        variants = build_variants(names, short_tokens=args.short_tokens, long_tokens=args.long_tokens,
                                  fanout_state_tokens=args.fanout_tokens, fanout_questions=args.fanout_questions,
                                  shared_states=args.shared_states)
        for v in variants:
            cs = overrides.get(v.name) or overrides.get(v.workload) or default_c
            first = factory.make(v, 0)
            if v.total_tokens is not None and first.expected_tokens is not None:
                floor = factory.min_total_tokens(v)
                if floor > v.total_tokens:
                    log(f"note: {v.name}: template + questions take {floor} tokens > target {v.total_tokens}; "
                        "the state is empty and requests are larger than the target")
            typical = v.typical_tokens or first.expected_tokens
            counts = {c: (v.requests if args.num_requests is None and v.requests else
                          requests_for(c, typical, args.num_requests)) for c in cs}
            t0 = time.perf_counter()
            offsets = None
            if args.unique_per_point and v.workload != "shared-state":
                # every point its own requests (and states): a state cache sees no repeats across points
                # or variants (fan-out variants would otherwise share their states)
                pool, offsets = [], {}
                for k, c in enumerate(cs):
                    offsets[c] = len(pool)
                    pool += factory.requests(v, counts[c], start=WARM_START * (2 + len(plan)) + 10_000 * k)
            else:
                pool = [first] + factory.requests(v, max(counts.values()) - 1, start=1)
            warm = factory.requests(v, args.warmup, start=WARM_START) if args.warmup else []
            log(f"generated {len(pool) + len(warm)} '{v.name}' requests in {time.perf_counter() - t0:.1f}s")
            plan.append(PlanItem(v, v.name, cs, pool, warm, counts, offsets))
    if args.requests:
        records = load_request_file(args.requests, args.limit, args.model_name)
        fac = factory or RequestFactory(None, seed=args.seed, model=args.model_name)
        pool = [fac.finish("file", r.body, r.label) for r in records]
        if not pool:
            raise SystemExit(f"clef-bench: {args.requests} has no requests")
        cs = overrides.get("file") or default_c
        counts = {c: min(len(pool), args.num_requests or len(pool)) for c in cs}
        warm = pool[: min(args.warmup, len(pool))]
        plan.append(PlanItem(None, "file", cs, pool, warm, counts))
    if not plan:
        raise SystemExit("clef-bench: nothing to run (choose --workload and/or --requests)")
    return plan

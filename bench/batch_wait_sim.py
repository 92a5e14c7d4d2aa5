"""Closed-loop clients against a model of one engine, to compare the scheduler's batch-wait rules (rule 5,
``clef_vllm.worker.batch_wait``) before a GPU does: the same decision code the scheduler runs, a step's GPU
time as a fixed cost plus a cost per token, and each answered client sending its next request after a
delay that grows with its place among the answers of its step (the front end answers them one by one).

    python bench/batch_wait_sim.py [-c 4 8 16 64] [--seconds 120] [--json OUT]

It prints req/s, steps per second and the mean step size per rule and concurrency, and the cohorts the
steps settle into. A model, not a measurement: its defaults come from the thirty-first session's 9B BF16
runs on one H200 (bench/results/README.md, "thirty-first"): ~22 ms a step plus 24.5 µs a token, answers
back after 1 ms + 0.3 ms per place + an exponential 0.5 ms. Which rule wins on the GPU is for
bench/paired.sh to say.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import random
from collections import Counter

from clef_vllm.contract import BATCH_WAIT_MODES
from clef_vllm.worker.batch_wait import BatchWait

POLL_S = 0.001          # an idle engine core that held its requests looks again after its idle millisecond


def simulate(concurrency: int, mode: str | None, wait_ms: float, *, seconds: float, step_fixed_ms: float,
             token_us: float, back_ms: float, per_place_ms: float, jitter_ms: float, budget: int,
             tokens: tuple[int, int], step_jitter: float, seed: int) -> dict:
    """One run: ``mode`` None is no wait. Returns req/s, steps/s, mean step size and the commonest step sizes
    over the run's second half."""
    rng = random.Random(seed)
    rule = BatchWait(wait_ms / 1000.0 if mode else 0.0, mode or BATCH_WAIT_MODES[0])
    events: list[tuple[float, int, str]] = []        # (time, order, kind)
    order = 0
    waiting: list[tuple[float, int]] = []            # (arrival, tokens), first come first served

    def push(t: float, kind: str) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind))

    for i in range(concurrency):                     # every client's first request, a little apart
        push(i * 1e-4, "arrive")
    busy_until = None
    running = 0                                      # requests in the step on the GPU
    done, sizes, steps = 0, [], 0
    half = seconds / 2
    while events:
        now, _, kind = heapq.heappop(events)
        if now > seconds:
            break
        if kind == "arrive":
            waiting.append((now, rng.randint(*tokens)))
            rule.arrival()
        elif kind == "end":
            answered = running
            busy_until = None
            rule.finished(now, answered, 0)
            if now >= half:
                done += answered
            for place in range(answered):
                push(now + (back_ms + place * per_place_ms + rng.expovariate(1 / jitter_ms)) / 1000.0, "arrive")
        if busy_until is not None or not waiting:
            continue
        if rule.hold(now, running=0, waiting=len(waiting), oldest=waiting[0][0],
                     waiting_tokens=lambda: sum(t for _, t in waiting), budget=budget):
            push(now + POLL_S, "poll")
            continue
        step_tokens, running = 0, 0
        while running < len(waiting) and step_tokens + waiting[running][1] <= budget:
            step_tokens += waiting[running][1]
            running += 1
        del waiting[:running]
        rule.stepped(now, running)
        step_ms = (step_fixed_ms + token_us * step_tokens / 1000.0) * rng.uniform(1 - step_jitter, 1 + step_jitter)
        busy_until = now + step_ms / 1000.0
        push(busy_until, "end")
        if now >= half:
            steps += 1
            sizes.append(running)
    span = seconds - half
    return {"concurrency": concurrency, "rule": f"{mode} {wait_ms:g} ms" if mode else "none",
            "req_per_s": round(done / span, 2), "steps_per_s": round(steps / span, 2),
            "mean_step": round(sum(sizes) / max(len(sizes), 1), 2), "held_steps": rule.held_steps,
            "commonest_steps": Counter(sizes).most_common(4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--concurrency", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--rules", nargs="+", default=["none", "half:2", "refill:2", "refill:5"],
                    help="none, or MODE:MS with MODE one of " + ", ".join(BATCH_WAIT_MODES))
    ap.add_argument("--seconds", type=float, default=120.0, help="simulated time per run (the second half counts)")
    ap.add_argument("--step-fixed-ms", type=float, default=22.0)
    ap.add_argument("--token-us", type=float, default=24.5)
    ap.add_argument("--back-ms", type=float, default=1.0, help="an answer's first client back after this")
    ap.add_argument("--per-place-ms", type=float, default=0.3, help="each later answer of the step this much later")
    ap.add_argument("--jitter-ms", type=float, default=0.5, help="mean of the exponential delay on top")
    ap.add_argument("--step-jitter", type=float, default=0.03, help="each step's time drawn within this fraction")
    ap.add_argument("--budget", type=int, default=16384, help="the step's token budget")
    ap.add_argument("--tokens", type=int, nargs=2, default=[380, 430], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'c':>3}  {'rule':<14} {'req/s':>7} {'vs none':>8} {'steps/s':>8} {'mean step':>10}  commonest steps")
    for c in args.concurrency:
        base = None
        for spec in args.rules:
            mode, _, ms = spec.partition(":")
            row = simulate(c, None if mode == "none" else mode, float(ms or 0), seconds=args.seconds,
                           step_fixed_ms=args.step_fixed_ms, token_us=args.token_us, back_ms=args.back_ms,
                           per_place_ms=args.per_place_ms, jitter_ms=args.jitter_ms, budget=args.budget,
                           tokens=tuple(args.tokens), step_jitter=args.step_jitter, seed=args.seed)
            base = base or row["req_per_s"]
            row["vs_none"] = round(row["req_per_s"] / base, 3)
            rows.append(row)
            common = ", ".join(f"{n}x{k}" for k, n in row["commonest_steps"])
            print(f"{c:>3}  {row['rule']:<14} {row['req_per_s']:>7.1f} {row['vs_none']:>8.3f} {row['steps_per_s']:>8.1f} "
                  f"{row['mean_step']:>10.1f}  {common}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "settings": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

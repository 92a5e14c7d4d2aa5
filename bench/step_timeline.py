"""Where an engine step's wall time goes, from a torch profiler trace (chrome JSON, plain or .gz).

The per-op tables (``profiler_out_0.txt``, ``bench/latency.py``'s ``most_host_time``) sum time by op;
they do not say *when* the GPU starts on a step. This script reads vLLM's engine-core trace (written
under ``CLEF_VLLM_PROFILE=DIR,START,COUNT``, or ``bench/latency.py``'s profiler) and, for every model
step (vLLM's ``execute_context_R(N)...`` annotation: R requests, N scheduled tokens), reports:

    requests, tokens   R and N

    wall_ms            the step's annotation, start to end
    launch_ms          from the step's start to its first CUDA graph launch (the host work before
                       it: vLLM's input preparation and attention-metadata builders, the plugin's
                       step-graph feed); the GPU waits for that launch
    ops_before         top-level host ops (aten ops, CUDA runtime calls) before that launch
    ops_before_by_window  the same per 0.5 ms from the step's start: count and most frequent names
                       (printed with --windows)
    kernels_before     GPU kernels and copies before it, and their busy time
    graph_launches     per CUDA graph launch: host ms of the call, its kernels, their busy ms and span,
                       and when its first kernel started after the call began (the call is queued
                       when that is later than the call's own duration)
    gpu_busy_ms        kernel and copy time of the step (by CUDA correlation with its host calls: the
                       runtime's and the driver's, which Triton and inductor kernels launch through;
                       overlaps counted once, as in clef_vllm.bench.gpu_timeline)
    gpu_end_ms         from the step's start to the end of its last kernel
    gpu_idle_ms        from its first kernel's start to its last kernel's end, the time no kernel or copy
                       of the step ran (launch gaps, host-to-device copies waiting for the host)
    gpu_idle_split     that idle time by the gap it falls in: ``short_gaps_ms`` (gaps under 50 µs: one
                       launch after another), ``before_host_copies_ms`` (longer gaps that end in a
                       host-to-device copy: the GPU waited for the host's data), ``other_ms``
    kernels_by_name    the step's GPU time by kernel name (the first 60 characters), the 12 largest, with
                       their calls (printed with --kernels): which kernels two steps differ in
    longest_gaps       the step's 8 longest idle gaps of at least 50 µs (printed with --gaps): the kernels
                       before and after each, when the host called the launch of the one after (ms into the
                       gap; negative: it was queued before the gap began) and the host ops that call sat in,
                       outermost first (the innermost three): what kept the host from launching sooner
                       (a GEMM op holding the host for ms before its one kernel, ended by a ``Lazy Function
                       Loading`` event, is CUDA loading a kernel on its first launch: docs/latency.md)

    start_ms           when the step began, ms after the first step's start; gpu_start_ms: its first kernel, ms
                       after its own start

    and over all the steps of the trace (``window`` in the JSON's summary, one line of the table): their
    requests and tokens, the span from the first step's first kernel to the last step's last kernel (the
    gaps between steps included), the GPU's busy time in it, and tokens per ms of that span: two engines'
    throughput over the same profiled window, whatever their steps' sizes

    lazy_loads         CUDA's lazy kernel loads in the step (the profiler's ``Lazy Function Loading`` events),
                       each with when it happened, the host op it ended (the innermost one around it: a GEMM
                       that waited from its call until the GPU drained holds the host that long) and every host
                       op around it, outermost first (the backbone's compiled graph, or the head's ops);
                       printed with --gaps

    python3 bench/step_timeline.py TRACE [--json OUT.json] [--windows] [--kernels] [--gaps]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

from clef_vllm.bench.gpu_timeline import union_length

STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")     # host calls that queue GPU work (Triton: cuLaunchKernelEx)
WINDOW_MS = 0.5      # ops_before_by_window
SHORT_GAP_US = 50    # gpu_idle_split: a gap shorter than this is one launch after another
KERNEL_NAMES, NAME_CHARS = 12, 60   # kernels_by_name
GAPS, GAP_OPS = 8, 3                # longest_gaps: how many, and how many enclosing host ops each


def load(path: str | Path) -> list[dict]:
    """The trace's events (``traceEvents``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def busy_ms(kernels) -> float:
    """GPU time of ``kernels`` (trace events), overlaps counted once."""
    return round(union_length((k["ts"], k["ts"] + k["dur"]) for k in kernels) / 1000, 3)


def idle_split(kernels: list[dict]) -> dict:
    """The idle time between ``kernels`` (trace events) by the gap it falls in (see ``gpu_idle_split``)."""
    split = {"short_gaps_ms": 0.0, "before_host_copies_ms": 0.0, "other_ms": 0.0}
    end = None
    for k in sorted(kernels, key=lambda k: k["ts"]):
        if end is not None and k["ts"] > end:
            gap = k["ts"] - end
            key = ("short_gaps_ms" if gap < SHORT_GAP_US else
                   "before_host_copies_ms" if k.get("name", "").startswith("Memcpy HtoD") else "other_ms")
            split[key] += gap / 1000
        end = max(end if end is not None else k["ts"], k["ts"] + k["dur"])
    return {key: round(ms, 3) for key, ms in split.items()}


def ops_around(ops: list[dict], ts: float) -> list[dict]:
    """The host ``ops`` running at ``ts``, outermost first."""
    return sorted((e for e in ops if e["ts"] <= ts < e["ts"] + e.get("dur", 0)), key=lambda e: (e["ts"], -e.get("dur", 0)))


def longest_gaps(kernels: list[dict], launches: dict, ops: list[dict], n: int = GAPS) -> list[dict]:
    """The ``n`` longest gaps between ``kernels`` of at least :data:`SHORT_GAP_US` (see ``longest_gaps``);
    ``launches`` maps a CUDA correlation id to the host call that launched it, ``ops`` are host ops."""
    gaps, end, last = [], None, None
    for k in sorted(kernels, key=lambda k: k["ts"]):
        if end is not None and k["ts"] - end >= SHORT_GAP_US:
            gaps.append((k["ts"] - end, end, last, k))
        if end is None or k["ts"] + k["dur"] > end:
            end, last = k["ts"] + k["dur"], k
    out = []
    for gap, start, before, after in sorted(gaps, key=lambda g: -g[0])[:n]:
        call = launches.get(after.get("args", {}).get("correlation"))
        row = {"ms": round(gap / 1000, 3), "before": before.get("name", "")[:NAME_CHARS],
               "after": after.get("name", "")[:NAME_CHARS], "launch_at_ms": None, "host_ops": []}
        if call is not None:
            row["launch_at_ms"] = round((call["ts"] - start) / 1000, 3)
            row["host_ops"] = [f"{e['name'][:NAME_CHARS]} ({e.get('dur', 0) / 1000:.2f} ms)"
                               for e in ops_around(ops, call["ts"])[-GAP_OPS:]]
        out.append(row)
    return out


LAZY_LOAD = "Lazy Function Loading"


def lazy_loads(events: list[dict], ops: list[dict], t0: float, t1: float) -> list[dict]:
    """CUDA's lazy kernel loads between ``t0`` and ``t1`` (see ``lazy_loads``); ``ops`` are host ops."""
    out = []
    for e in sorted((e for e in events if e.get("name") == LAZY_LOAD and t0 <= e["ts"] < t1), key=lambda e: e["ts"]):
        around = ops_around(ops, e["ts"])
        inner = min(around, key=lambda o: o.get("dur", 0), default=None)
        out.append({"at_ms": round((e["ts"] - t0) / 1000, 3), "op": inner["name"][:NAME_CHARS] if inner else None,
                    "op_ms": round(inner.get("dur", 0) / 1000, 3) if inner else None,
                    "host_ops": [o["name"][:NAME_CHARS] for o in around]})
    return out


def top_level(events: list[dict]) -> list[dict]:
    """Events not nested in an earlier one (``events`` sorted by start)."""
    out, end = [], float("-inf")
    for e in events:
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e.get("dur", 0)
    return out


def windows(ops: list[dict], t0: float, width_ms: float = WINDOW_MS) -> list[dict]:
    """``ops`` (top-level host ops) in windows of ``width_ms`` from ``t0``: how many start in each and the
    most frequent names (the pattern in time of the work before a step's graph launch)."""
    by_window = defaultdict(list)
    for e in ops:
        by_window[int((e["ts"] - t0) // (width_ms * 1000))].append(e["name"])
    return [{"from_ms": round(w * width_ms, 3), "ops": len(names),
             "most": [f"{name} x{count}" for name, count in Counter(names).most_common(4)]}
            for w, names in sorted(by_window.items())]


def by_name(kernels: list[dict]) -> list[dict]:
    """GPU time by kernel name (its first :data:`NAME_CHARS` characters), the :data:`KERNEL_NAMES` largest."""
    total, calls = Counter(), Counter()
    for k in kernels:
        name = k.get("name", "")[:NAME_CHARS]
        total[name] += k["dur"]
        calls[name] += 1
    return [{"name": name, "calls": calls[name], "ms": round(us / 1000, 3)} for name, us in total.most_common(KERNEL_NAMES)]


def steps(events: list[dict]) -> list[dict]:
    """One summary per model step that schedules tokens (see the module docstring), in time order."""
    spans = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and (m := STEP.match(e.get("name", ""))) and int(m.group(2)) > 0), key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS + LAUNCH_CATS),
                  key=lambda e: e["ts"])
    loads = [e for e in events if e.get("ph") == "X" and e.get("name") == LAZY_LOAD]
    gpu_by_corr = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            gpu_by_corr[e.get("args", {}).get("correlation")].append(e)

    def kernels_of(calls):
        return [k for e in calls for k in gpu_by_corr.get(e.get("args", {}).get("correlation"), ())]

    out = []
    origin = spans[0]["ts"] if spans else 0
    for span in spans:
        t0, t1 = span["ts"], span["ts"] + span["dur"]
        inside = [e for e in host if t0 <= e["ts"] < t1]
        runtime = [e for e in inside if e.get("cat") in LAUNCH_CATS]
        launched_by = {e.get("args", {}).get("correlation"): e for e in runtime}
        cpu_ops = [e for e in inside if e.get("cat") == "cpu_op"]
        gpu = kernels_of(runtime)
        launches = [e for e in runtime if e.get("name") == "cudaGraphLaunch"]
        first = launches[0]["ts"] if launches else t1
        before = kernels_of(e for e in runtime if e["ts"] < first)
        graphs = []
        for launch in launches:
            kernels = kernels_of([launch])
            start = min((k["ts"] for k in kernels), default=None)
            graphs.append({"host_ms": round(launch.get("dur", 0) / 1000, 3), "kernels": len(kernels),
                           "busy_ms": busy_ms(kernels),
                           "span_ms": round((max(k["ts"] + k["dur"] for k in kernels) - start) / 1000, 3)
                           if kernels else None,
                           "first_kernel_after_ms": round((start - launch["ts"]) / 1000, 3) if kernels else None})
        ops = top_level([e for e in inside if e["ts"] < first and e.get("cat") in HOST_CATS])
        m = STEP.match(span["name"])
        out.append({
            "requests": int(m.group(1)),
            "tokens": int(m.group(2)),
            "wall_ms": round(span["dur"] / 1000, 3),
            "start_ms": round((t0 - origin) / 1000, 3),
            "gpu_start_ms": round((min(k["ts"] for k in gpu) - t0) / 1000, 3) if gpu else None,
            "launch_ms": round((first - t0) / 1000, 3) if launches else None,
            "ops_before": len(ops),
            "ops_before_by_window": windows(ops, t0),
            "kernels_before": len(before),
            "kernels_before_busy_ms": busy_ms(before),
            "graph_launches": graphs,
            "gpu_busy_ms": busy_ms(gpu),
            "gpu_end_ms": round((max(k["ts"] + k["dur"] for k in gpu) - t0) / 1000, 3) if gpu else None,
            "gpu_idle_ms": round((max(k["ts"] + k["dur"] for k in gpu) - min(k["ts"] for k in gpu)) / 1000
                                 - busy_ms(gpu), 3) if gpu else None,
            "gpu_idle_split": idle_split(gpu) if gpu else None,
            "kernels_by_name": by_name(gpu),
            "longest_gaps": longest_gaps(gpu, launched_by, cpu_ops),
            "lazy_loads": lazy_loads(loads, cpu_ops, t0, t1),
        })
    return out


def summary(rows: list[dict]) -> dict:
    """Medians over the steps."""
    def med(key):
        values = [r[key] for r in rows if r[key] is not None]
        return round(statistics.median(values), 3) if values else None
    return {"steps": len(rows), "mean_requests": round(statistics.mean(r["requests"] for r in rows), 2),
            **{f"median_{k}": med(k) for k in
                                   ("wall_ms", "launch_ms", "ops_before", "gpu_busy_ms", "gpu_end_ms",
                                    "gpu_idle_ms")},
            "window": window(rows)}


def window(rows: list[dict]) -> dict | None:
    """All the steps together: requests, tokens, the span from the first one's first kernel to the last one's
    last kernel (gaps between steps included), GPU busy and idle ms in it, tokens per ms of it."""
    ran = [r for r in rows if r["gpu_start_ms"] is not None]
    if not ran:
        return None
    span = ran[-1]["start_ms"] + ran[-1]["gpu_end_ms"] - (ran[0]["start_ms"] + ran[0]["gpu_start_ms"])
    busy = sum(r["gpu_busy_ms"] for r in ran)
    tokens = sum(r["tokens"] for r in ran)
    return {"steps": len(ran), "requests": sum(r["requests"] for r in ran), "tokens": tokens,
            "span_ms": round(span, 3), "busy_ms": round(busy, 3), "idle_ms": round(span - busy, 3),
            "tokens_per_ms": round(tokens / span, 3) if span > 0 else None}


def table(rows: list[dict]) -> str:
    lines = ["reqs  tokens  wall ms  launch at ms  ops before  kernels before (ms)  graph launches: host ms / kernels / busy ms"
             "  GPU busy ms  GPU ends at ms  GPU idle ms"]
    for r in rows:
        graphs = "; ".join(f"{g['host_ms']:.2f} / {g['kernels']} / {g['busy_ms']:.2f}" for g in r["graph_launches"]) or "-"
        launch = "-" if r["launch_ms"] is None else f"{r['launch_ms']:.2f}"
        end = "-" if r["gpu_end_ms"] is None else f"{r['gpu_end_ms']:.2f}"
        idle = "-" if r["gpu_idle_ms"] is None else f"{r['gpu_idle_ms']:.2f}"
        lines.append(f"{r['requests']:4d}  {r['tokens']:6d}  {r['wall_ms']:7.2f}  {launch:>12}  {r['ops_before']:10d}  "
                     f"{r['kernels_before']:5d} ({r['kernels_before_busy_ms']:.2f})  {graphs}  "
                     f"{r['gpu_busy_ms']:11.2f}  {end:>14}  {idle:>11}")
    s = summary(rows)
    lines.append(f"{s['mean_requests']} requests a step (mean); median over {s['steps']} steps: wall {s['median_wall_ms']} ms, first graph launch at "
                 f"{s['median_launch_ms']} ms after {s['median_ops_before']} host ops, GPU busy {s['median_gpu_busy_ms']} ms, "
                 f"GPU done at {s['median_gpu_end_ms']} ms, GPU idle {s['median_gpu_idle_ms']} ms between its first and last kernel")
    w = s["window"]
    if w is not None:
        lines.append(f"all {w['steps']} steps: {w['requests']} requests, {w['tokens']} tokens in {w['span_ms']} ms from the first "
                     f"kernel to the last (GPU busy {w['busy_ms']}, idle {w['idle_ms']}, gaps between steps included): "
                     f"{w['tokens_per_ms']} tokens per ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a torch profiler chrome trace (.json or .json.gz)")
    ap.add_argument("--json", help="also write the steps and their medians here")
    ap.add_argument("--windows", action="store_true", help="also print each step's host ops before its launch, "
                    "per 0.5 ms window")
    ap.add_argument("--kernels", action="store_true", help="also print each step's GPU time by kernel name")
    ap.add_argument("--gaps", action="store_true", help="also print each step's longest GPU idle gaps and the host "
                    "ops its next launch waited in")
    args = ap.parse_args(argv)
    rows = steps(load(args.trace))
    if not rows:
        print(f"{args.trace}: no model step (execute_context_N(tokens) annotation) in the trace", file=sys.stderr)
        return 1
    print(table(rows))
    if args.windows:
        for r in rows:
            print(f"\n{r['tokens']}-token step, host ops before its first graph launch, per {WINDOW_MS} ms:")
            for w in r["ops_before_by_window"]:
                print(f"  {w['from_ms']:6.1f} ms  {w['ops']:3d} ops  {', '.join(w['most'])}")
    if args.kernels:
        for r in rows:
            print(f"\n{r['requests']}-request {r['tokens']}-token step, GPU time by kernel ({KERNEL_NAMES} largest):")
            for k in r["kernels_by_name"]:
                print(f"  {k['ms']:8.3f} ms  {k['calls']:4d}  {k['name']}")
    if args.gaps:
        for r in rows:
            print(f"\n{r['requests']}-request {r['tokens']}-token step, longest GPU idle gaps "
                  "(ms; launch called at ms into the gap; in host ops):")
            for g in r["longest_gaps"]:
                at = "-" if g["launch_at_ms"] is None else f"{g['launch_at_ms']:.2f}"
                print(f"  {g['ms']:6.2f}  {g['before']} -> {g['after']}  at {at}  in {' > '.join(g['host_ops']) or '-'}")
            loads = r["lazy_loads"]
            print(f"  lazy kernel loads: {len(loads)}" + "".join(
                f"\n    at {x['at_ms']:.2f} ms, ending {x['op']} ({x['op_ms']:.2f} ms) in {' > '.join(x['host_ops'])}"
                if x["op"] else
                f"\n    at {x['at_ms']:.2f} ms" for x in loads))
    if args.json:
        Path(args.json).write_text(json.dumps({"trace": Path(args.trace).name, "steps": rows,
                                               "summary": summary(rows)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

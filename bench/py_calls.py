"""Which Python code an engine step's host time goes to, from a torch profiler trace recorded with Python
stacks (``CLEF_VLLM_PROFILE=DIR,START,COUNT,stack``: the profiler's ``python_function`` events).

    python3 bench/py_calls.py TRACE [--root NAME] [--depth 4] [--min-ms 0.05] [--json OUT] [--per-step]

Each step is one of vLLM's ``execute_context_*`` ranges (the whole trace when it has none). Inside a step,
the Python calls on the step's thread form a tree (the profiler records each call's parent); the calls
are summed by their path from ``--root`` (default: the model runner's ``execute_model``; the step's
outermost calls when no call of that name is in it), and printed as a tree to ``--depth``: per path, the
median over steps of its inclusive milliseconds and of its number of calls, children by time, those below
``--min-ms`` left out. The Python tracer slows every call, so the times rank the code rather than measure
it: read them as shares of the profiled step.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict

STEP_PREFIX = "execute_context"
DEFAULT_ROOT = "execute_model"


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def short(name: str) -> str:
    """``vllm/v1/worker/gpu_model_runner.py(1241): _update_states`` -> ``_update_states (gpu_model_runner.py:1241)``."""
    where, _, func = name.partition("): ")
    if not func:
        return name
    path, _, line = where.rpartition("(")
    return f"{func} ({path.rsplit('/', 1)[-1]}:{line})"


def steps_of(events: list[dict]) -> list[tuple[float, float, object]]:
    """(start, end, thread) of each step range; one window over everything when there is none."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
                    if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith(STEP_PREFIX))
    if ranges:
        return ranges
    calls = [e for e in events if e.get("cat") == "python_function"]
    if not calls:
        return []
    return [(min(e["ts"] for e in calls), max(e["ts"] + e["dur"] for e in calls), None)]


def step_tree(calls: list[dict], root: str) -> dict[tuple[str, ...], list[float]]:
    """Path (names from the root call down) -> [inclusive ms, calls] for one step's Python calls."""
    by_id = {e["args"]["Python id"]: e for e in calls}
    children = defaultdict(list)
    for e in calls:
        children[e["args"].get("Python parent id")].append(e)
    roots = [e for e in calls if short(e["name"]).split(" ")[0] == root]
    if roots:     # the outermost calls of that name (not those nested in another of them)
        roots = [e for e in roots if not any(short(a["name"]).split(" ")[0] == root for a in ancestors(e, by_id))]
    else:
        roots = [e for e in calls if e["args"].get("Python parent id") not in by_id]
    out: dict[tuple[str, ...], list[float]] = {}

    def walk(e, path):
        path = path + (short(e["name"]),)
        acc = out.setdefault(path, [0.0, 0])
        acc[0] += e["dur"] / 1000.0
        acc[1] += 1
        for c in children.get(e["args"]["Python id"], ()):
            walk(c, path)

    for e in roots:
        walk(e, ())
    return out


def ancestors(e: dict, by_id: dict):
    parent = by_id.get(e["args"].get("Python parent id"))
    while parent is not None:
        yield parent
        parent = by_id.get(parent["args"].get("Python parent id"))


def step_trees(events: list[dict], root: str = DEFAULT_ROOT) -> list[dict]:
    """Each step's call tree (:func:`step_tree`), in the order of the steps."""
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function" and "args" in e]
    return [step_tree([e for e in calls if start <= e["ts"] <= end and (tid is None or e.get("tid") == tid)], root)
            for start, end, tid in steps_of(events)]


def summarise(events: list[dict], root: str = DEFAULT_ROOT, per_step: list[dict] | None = None) -> dict:
    """The median over steps (``per_step``: given trees, default all of the trace's) of each call path's
    inclusive milliseconds and calls."""
    per_step = step_trees(events, root) if per_step is None else per_step
    paths = {p for tree in per_step for p in tree}
    rows = {}
    for p in paths:
        ms = [tree.get(p, [0.0, 0])[0] for tree in per_step]
        n = [tree.get(p, [0.0, 0])[1] for tree in per_step]
        rows[p] = {"ms": statistics.median(ms), "calls": statistics.median(n)}
    return {"steps": len(per_step), "root": root, "paths": rows}


def render(summary: dict, depth: int = 4, min_ms: float = 0.05) -> list[str]:
    rows = summary["paths"]
    kids = defaultdict(list)
    for p in rows:
        kids[p[:-1]].append(p)
    lines = [f"{summary['steps']} steps; median inclusive ms and calls per step, from {summary['root']!r}"]

    def emit(parent, level):
        for p in sorted(kids.get(parent, ()), key=lambda q: -rows[q]["ms"]):
            if rows[p]["ms"] < min_ms:
                continue
            lines.append(f"{rows[p]['ms']:9.3f} ms {rows[p]['calls']:7g}x  {'  ' * level}{p[-1]}")
            if level + 1 < depth:
                emit(p, level + 1)

    emit((), 0)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a torch profiler chrome trace recorded with Python stacks (.json or .json.gz)")
    ap.add_argument("--root", default=DEFAULT_ROOT, help=f"the call the tree starts from (default {DEFAULT_ROOT})")
    ap.add_argument("--depth", type=int, default=4, help="levels printed (default 4)")
    ap.add_argument("--min-ms", type=float, default=0.05, help="leave out paths below this (default 0.05)")
    ap.add_argument("--json", help="also write every path's medians here")
    ap.add_argument("--per-step", action="store_true", help="after the medians, each step's own tree")
    a = ap.parse_args(argv)
    events = load(a.trace)
    trees = step_trees(events, a.root)
    summary = summarise(events, a.root, trees)
    if not summary["paths"]:
        print(f"{a.trace}: no Python calls (record with CLEF_VLLM_PROFILE=DIR,START,COUNT,stack)", file=sys.stderr)
        return 1
    print("\n".join(render(summary, a.depth, a.min_ms)))
    for k, tree in enumerate(trees if a.per_step else ()):
        lines = render(summarise(events, a.root, [tree]), a.depth, a.min_ms)
        print(f"\nstep {k + 1} of {len(trees)}:\n" + "\n".join(lines[1:]))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"steps": summary["steps"], "root": summary["root"],
                       "paths": [{"path": list(p), **v} for p, v in sorted(summary["paths"].items())]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

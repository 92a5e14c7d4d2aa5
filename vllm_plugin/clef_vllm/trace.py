"""Request timeline events for diagnosis: where a request's time goes between the server's backend
call and vLLM's engine core (another process).

Off unless ``CLEF_VLLM_TRACE`` names a file. Then each event appends one JSON line
``{"t": wall seconds, "pid": ..., "event": ..., "request": ...}``: ``submit`` / ``answer`` around the
backend's engine call (server process), ``engine_add`` / ``engine_scheduled`` / ``engine_done`` in
the engine core (``ClefScheduler``). Wall-clock time is comparable across the processes of one machine.
``python -m clef_vllm.trace FILE`` prints the median of each segment between them.
"""

from __future__ import annotations

import json
import os
import time

PATH = os.environ.get("CLEF_VLLM_TRACE") or None


def event(name: str, request_id: str) -> None:
    """Append one event (a no-op unless ``CLEF_VLLM_TRACE`` is set)."""
    if PATH is None:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "event": name, "request": request_id}) + "\n"
    with open(PATH, "a", encoding="utf-8") as f:
        f.write(line)


#: The segments of one request's timeline, between consecutive events.
SEGMENTS = (("submit", "engine_add", "to the engine core (input processing, IPC, hashing)"),
            ("engine_add", "engine_scheduled", "waiting for a step"),
            ("engine_scheduled", "engine_done", "its steps"),
            ("engine_done", "answer", "back to the server (output, IPC)"))


def timelines(lines) -> dict[str, dict[str, float]]:
    """Per request (the server's id), the first time of each event. The engine core's ids are the
    server's plus vLLM's ``-xxxxxxxx`` suffix; they are mapped back by prefix."""
    events = [json.loads(line) for line in lines if line.strip()]
    ours = {e["request"] for e in events if e["event"] in ("submit", "answer")}
    out: dict[str, dict[str, float]] = {}
    for e in events:
        rid = e["request"]
        if rid not in ours:
            base = rid.rsplit("-", 1)[0]
            rid = base if base in ours else rid
        out.setdefault(rid, {}).setdefault(e["event"], e["t"])
    return out


def summary(lines) -> dict:
    """Median milliseconds of each segment over the requests that have both ends, and how many had."""
    import statistics

    per = timelines(lines)
    rows = {}
    for a, b, what in SEGMENTS:
        values = [(t[b] - t[a]) * 1000 for t in per.values() if a in t and b in t]
        rows[f"{a} -> {b}"] = {"what": what, "requests": len(values),
                               "p50_ms": round(statistics.median(values), 3) if values else None}
    whole = [(t["answer"] - t["submit"]) * 1000 for t in per.values() if "submit" in t and "answer" in t]
    rows["submit -> answer"] = {"what": "the backend's engine call", "requests": len(whole),
                                "p50_ms": round(statistics.median(whole), 3) if whole else None}
    return rows


def main(argv=None) -> int:
    """``python -m clef_vllm.trace FILE``: the median of each segment of the traced requests."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m clef_vllm.trace", description=main.__doc__)
    ap.add_argument("file", help="a CLEF_VLLM_TRACE file")
    a = ap.parse_args(argv)
    with open(a.file, encoding="utf-8") as f:
        rows = summary(f)
    for name, row in rows.items():
        p50 = "-" if row["p50_ms"] is None else f"{row['p50_ms']:.2f} ms"
        print(f"{name:36s} {p50:>11s}  ({row['requests']} requests)  {row['what']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

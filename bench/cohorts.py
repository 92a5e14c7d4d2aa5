"""The cohorts a closed loop of clients settles into, read from a server's access log: answers that leave
within a few milliseconds of each other came from one engine step (``clef_vllm.bench.cohorts``), so their
groups show the steps' sizes over time (e.g. a c=16 load alternating steps of 14 and 2 requests instead of running all 16 at once), and
each request's arrival (its answer's time less its duration) against the answers before it shows how
long the clients took to come back.

A group whose clients did not come back at once (fewer than half of its requests arrived within ``--back-ms``
of its last answer) is a late group: its requests miss the step they would have joined and the cycle
reshapes. Each one is listed with the server's own lines about a held loop near it (``garbage collector:
a full collection stopped ...``, ``event loop (...): a timer ran ... late``), to tell a server-side stall
from a client-side one (``clef-bench --versus`` records its clients' own stalls per block).

A time block's end looks the same (its clients stop; with blocks A B B A the same server's next block starts
as its last cohort drains): ``--blocks BENCH_JSON`` (clef-bench ``--versus``'s result, whose blocks record
``started_unix``) leaves out a late group that a block start follows within :data:`BLOCK_END_S`.

    python bench/cohorts.py SERVER_LOG [--since HH:MM:SS] [--until HH:MM:SS] [--gap-ms 15] [--back-ms 50]
                            [--blocks BENCH_JSON] [--json OUT]

Reads the text and the JSON log formats (``--log-format``); the access log's clock has millisecond
resolution, so groups closer than ``--gap-ms`` merge.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import re
import sys

from clef_vllm.bench.cohorts import GROUP_GAP_S, size_histogram, split_groups
from clef_vllm.bench.loadgen import percentile
from clef_vllm.server.loop_lag import STALL_LINE
from clef_vllm.util.heap import LONG_PAUSE_LINE

TEXT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO clef_vllm\.access\b.*? duration_ms=([\d.]+)")
#: the server's lines about a held event loop (clef_vllm.util.heap, clef_vllm.server.loop_lag) start so
HELD_JSON = (LONG_PAUSE_LINE, STALL_LINE)
#: ... and in the text format
HELD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) WARNING \S+: "
                  r"((?:" + "|".join(re.escape(start) for start in HELD_JSON) + r").*)")
#: a late group's neighbourhood, seconds each side, for the held-loop lines printed with it
NEAR_S = 0.5
#: no request for this long after a group: the clients stopped (a time block's end), not a late group
END_S = 2.0
#: a late group followed this soon by a clef-bench block's start ends the block before it (``--blocks``)
BLOCK_END_S = 1.0


def block_starts(path: str) -> list[float]:
    """Every time block's start (``started_unix``) in a clef-bench ``--versus`` result."""
    with open(path) as fh:
        result = json.load(fh)
    return sorted(blk["started_unix"] for v in result.get("variants", []) for blk in v.get("blocks", [])
                  if blk.get("started_unix") is not None)


def late_groups(done: list[tuple[float, float]], gap_s: float, back_s: float, smallest: int = 4,
                starts: list[float] = ()) -> list[dict]:
    """Groups of at least ``smallest`` answers of which fewer than half came back (a request arriving) within
    ``back_s`` of the group's last answer: when (its last answer), its size, how many came back in time, and
    how long after it the first request after that window arrived (ms). A group after which nothing arrives for
    :data:`END_S` ends the clients' run (a time block), not late, and so does one that a time block's start
    (``starts``) follows within :data:`BLOCK_END_S`."""
    arrivals = sorted(when - took for when, took in done)
    out = []
    for group in split_groups([a[0] for a in done], gap_s):
        if len(group) < smallest:
            continue
        end = group[-1]
        lo, hi = bisect.bisect_right(arrivals, end), bisect.bisect_right(arrivals, end + back_s)
        if hi - lo >= len(group) / 2:
            continue
        if hi == len(arrivals) or arrivals[hi] - end > END_S:
            continue                      # nothing came for a while: the clients stopped (a block's or the run's end)
        k = bisect.bisect_right(starts, end)
        if k < len(starts) and starts[k] - end <= BLOCK_END_S:
            continue                      # the next block started: this one had ended
        out.append({"at": end, "size": len(group), "back": hi - lo,
                    "next_after_ms": round((arrivals[hi] - end) * 1000.0, 1) if hi < len(arrivals) else None})
    return out


def read_log(lines) -> tuple[list[tuple[float, float]], list[tuple[float, str]]]:
    """From a server log (text or JSON format): ``(answered_at, duration_s)`` of every access-log line, and
    ``(time, message)`` of the server's lines about a held event loop; seconds since the epoch (the text
    format's local clock), each list in time order."""
    done, held = [], []
    for line in lines:
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "ts" not in rec:
                continue
            when = datetime.datetime.strptime(rec["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                tzinfo=datetime.timezone.utc).timestamp()
            message = str(rec.get("message", ""))
            if rec.get("logger") == "clef_vllm.access" and "duration_ms" in rec:
                done.append((when, float(rec["duration_ms"]) / 1000.0))
            elif message.startswith(HELD_JSON):
                held.append((when, message))
            continue
        m = TEXT.match(line) or HELD.match(line)
        if m:
            when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
            if m.re is TEXT:
                done.append((when, float(m.group(3)) / 1000.0))
            else:
                held.append((when, m.group(3)))
    return sorted(done), sorted(held)


def summary(done: list[tuple[float, float]], gap_s: float) -> dict:
    """Group sizes (histogram, the sequence with the milliseconds from one group's first answer to the next's) and
    each arrival's milliseconds after the latest answer before it."""
    ends = [a[0] for a in done]
    grouped = split_groups(ends, gap_s)
    back = []
    for when, took in done:
        i = bisect.bisect_right(ends, when - took) - 1
        if i >= 0:
            back.append((when - took - ends[i]) * 1000.0)
    return {"answers": len(done), "groups": len(grouped),
            "sizes": size_histogram(grouped),
            "sequence": [(len(g), round((g[0] - grouped[i - 1][0]) * 1000.0) if i else 0)
                         for i, g in enumerate(grouped)],
            "back_ms_p10_p50_p90": [round(percentile(back, q), 2) for q in (10, 50, 90)] if back else []}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--since", help="HH:MM:SS on the log's own clock (text format) or UTC (JSON)")
    ap.add_argument("--until")
    ap.add_argument("--gap-ms", type=float, default=GROUP_GAP_S * 1000.0)
    ap.add_argument("--back-ms", type=float, default=50.0,
                    help="a group of which fewer than half came back within this is a late group")
    ap.add_argument("--blocks", help="clef-bench --versus result: late groups that end a time block are left out")
    ap.add_argument("--show", type=int, default=60, help="groups of the sequence to print")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args(argv)
    with open(args.log, errors="replace") as fh:
        lines = fh.readlines()
    done, held = read_log(lines)

    def clock(t: float) -> str:
        return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S")

    done = [a for a in done if (not args.since or clock(a[0]) >= args.since) and (not args.until or clock(a[0]) <= args.until)]
    out = summary(done, args.gap_ms / 1000.0)
    late = late_groups(done, args.gap_ms / 1000.0, args.back_ms / 1000.0,
                       starts=block_starts(args.blocks) if args.blocks else [])
    for group in late:
        group["held_lines_near"] = [[round((when - group["at"]) * 1000.0), msg] for when, msg in held
                                    if abs(when - group["at"]) <= NEAR_S]
    out["late_groups"] = [{**g, "at": datetime.datetime.fromtimestamp(g["at"]).strftime("%H:%M:%S.%f")[:-3]}
                          for g in late]
    out["held_lines"] = len([1 for when, _ in held if (not done) or done[0][0] <= when <= done[-1][0]])
    print(f"{out['answers']} answers in {out['groups']} groups (answers closer than {args.gap_ms:g} ms)")
    print("group sizes: " + ", ".join(f"{n}: {k}" for n, k in out["sizes"]))
    print("arrivals after the latest answer before them, ms p10/p50/p90: "
          + " / ".join(str(v) for v in out["back_ms_p10_p50_p90"]))
    print("sequence (size@ms since the previous group): "
          + " ".join(f"{n}@{ms}" for n, ms in out["sequence"][:args.show]))
    print(f"late groups (fewer than half back within {args.back_ms:g} ms): {len(late)}; the server's held-loop "
          f"lines over the same time: {out['held_lines']}")
    for g in out["late_groups"]:
        print(f"  {g['at']} a group of {g['size']}: {g['back']} back within {args.back_ms:g} ms, the next arrival "
              f"{g['next_after_ms']:g} ms after it"
              + "".join(f"\n      {ms:+d} ms: {msg}" for ms, msg in g["held_lines_near"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, **out}, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The cohorts a closed loop of clients settles into, read from a server's access log: answers that leave
within a few milliseconds of each other came from one engine step (``clef_vllm.bench.cohorts``), so their
groups show the steps' sizes over time (e.g. a c=16 load alternating steps of 14 and 2 requests instead of running all 16 at once), and
each request's arrival (its answer's time less its duration) against the answers before it shows how
long the clients took to come back.

    python bench/cohorts.py SERVER_LOG [--since HH:MM:SS] [--until HH:MM:SS] [--gap-ms 15] [--json OUT]

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

TEXT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO clef_vllm\.access\b.*? duration_ms=([\d.]+)")


def answers(lines) -> list[tuple[float, float]]:
    """``(answered_at, duration_s)`` of every access-log line (seconds since the epoch, local clock)."""
    out = []
    for line in lines:
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("logger") != "clef_vllm.access" or "duration_ms" not in rec:
                continue
            when = datetime.datetime.strptime(rec["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                tzinfo=datetime.timezone.utc).timestamp()
            out.append((when, float(rec["duration_ms"]) / 1000.0))
            continue
        m = TEXT.match(line)
        if m:
            when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
            out.append((when, float(m.group(3)) / 1000.0))
    return sorted(out)


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
    ap.add_argument("--show", type=int, default=60, help="groups of the sequence to print")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args(argv)
    with open(args.log, errors="replace") as fh:
        done = answers(fh)

    def clock(t: float) -> str:
        return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S")

    done = [a for a in done if (not args.since or clock(a[0]) >= args.since) and (not args.until or clock(a[0]) <= args.until)]
    out = summary(done, args.gap_ms / 1000.0)
    print(f"{out['answers']} answers in {out['groups']} groups (answers closer than {args.gap_ms:g} ms)")
    print("group sizes: " + ", ".join(f"{n}: {k}" for n, k in out["sizes"]))
    print("arrivals after the latest answer before them, ms p10/p50/p90: "
          + " / ".join(str(v) for v in out["back_ms_p10_p50_p90"]))
    print("sequence (size@ms since the previous group): "
          + " ".join(f"{n}@{ms}" for n, ms in out["sequence"][:args.show]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, **out}, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

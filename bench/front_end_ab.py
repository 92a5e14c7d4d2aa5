"""Two front-end variants side by side on CPU: the real ``clef-systemone`` app over an instant backend
(``bench/instant_server.py``), A with ``--a`` and B with ``--b`` as its extra flags, clef-bench against
each in alternating rounds (A B, B A, ...), so both sample the same minutes of the machine.

    python bench/front_end_ab.py CKPT --a "--cpu-inline-bytes 0" --b "" [-c 1 16 64] [--rounds 4] [-o OUT.json]

CKPT: any checkpoint folder (its tokenizer). Prints, per concurrency, each side's median req/s, p50
and server stages over the rounds, and B over A; the JSON keeps every round. With an instant backend
this is the front-end's own ceiling: what the server costs per request outside the engine.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from clef_vllm.bench.runs import bench_point, save
from clef_vllm.testing.server import LiveServer


def run_point(url: str, checkpoint: str, workload: str, concurrency: int, requests: int, out: Path) -> dict:
    """One clef-bench run: req/s, client p50 and the server's stage medians."""
    point = bench_point(url, checkpoint, workload, concurrency, requests, out, warmup=8)
    return {"req_per_s": round(point["req_per_s"], 2), "p50_ms": point["latency_ms"]["p50"],
            "p99_ms": point["latency_ms"]["p99"], "stages_p50_ms": point.get("server_stages_p50_ms")}


def median_of(rounds: list[dict]) -> dict:
    stages = {}
    for name in (rounds[0]["stages_p50_ms"] or {}):
        stages[name] = round(statistics.median(r["stages_p50_ms"][name] for r in rounds), 3)
    return {"req_per_s": round(statistics.median(r["req_per_s"] for r in rounds), 2),
            "p50_ms": round(statistics.median(r["p50_ms"] for r in rounds), 3),
            "p99_ms": round(statistics.median(r["p99_ms"] for r in rounds), 3), "stages_p50_ms": stages}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--a", default="", help="instant_server.py flags of variant A")
    ap.add_argument("--b", default="", help="instant_server.py flags of variant B")
    ap.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("-n", "--num-requests", type=int, default=1000, help="requests per run [1000]")
    ap.add_argument("--rounds", type=int, default=4, help="runs per side and concurrency, alternating [4]")
    ap.add_argument("--workload", default="short")
    ap.add_argument("-o", "--out", help="write the results here (JSON)")
    a = ap.parse_args(argv)

    script = str(Path(__file__).with_name("instant_server.py"))
    servers = {side: LiveServer([], ready_timeout=120, command=lambda port, flags=flags: [
        sys.executable, script, a.checkpoint, str(port), *shlex.split(flags)]) for side, flags in (("a", a.a), ("b", a.b))}
    results: dict[int, dict[str, list[dict]]] = {}
    try:
        for server in servers.values():
            server.wait_ready()
        with tempfile.TemporaryDirectory() as tmp:
            for c in a.concurrency:
                results[c] = {"a": [], "b": []}
                for r in range(a.rounds):
                    for side in ("ab" if r % 2 == 0 else "ba"):
                        results[c][side].append(run_point(servers[side].url, a.checkpoint, a.workload, c,
                                                          a.num_requests, Path(tmp) / f"{side}_c{c}_{r}.json"))
    finally:
        for server in servers.values():
            server.stop(timeout=30)

    points = []
    print(f"A: instant_server.py {a.a or '(defaults)'}   B: instant_server.py {a.b or '(defaults)'}   "
          f"{a.workload}, {a.num_requests} requests a run, {a.rounds} rounds a side, medians")
    print(" c   A req/s   B req/s   B/A   A p50 ms   B p50 ms   A p99 ms   B p99 ms   A stages p50 ms / B stages p50 ms")
    for c, sides in results.items():
        ma, mb = median_of(sides["a"]), median_of(sides["b"])
        ratio = round(mb["req_per_s"] / ma["req_per_s"], 3)
        points.append({"concurrency": c, "a": ma, "b": mb, "b_over_a_req_per_s": ratio, "rounds": sides})
        fmt = lambda m: ", ".join(f"{k} {v}" for k, v in m["stages_p50_ms"].items())  # noqa: E731
        print(f"{c:2d}  {ma['req_per_s']:8.1f}  {mb['req_per_s']:8.1f}  {ratio:5.3f}  {ma['p50_ms']:9.2f}  "
              f"{mb['p50_ms']:9.2f}  {ma['p99_ms']:9.2f}  {mb['p99_ms']:9.2f}   {fmt(ma)} / {fmt(mb)}")
    save(a.out, a, points)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one hop from the event loop to a thread of the server's CPU pool and back costs (CPU only).

The server's CPU pool (``clef_vllm.server.service.CpuPool``) runs a request's decode, encode and answer
in threads; a request whose body is at most ``--cpu-inline-bytes`` does that work on the event loop,
because its four hops cost about as much as a short decision's work. This measures a hop with an empty job:
one at a time, and 64 requests' hops interleaved. Prints CPU and wall microseconds per hop.

    python bench/pool_hop.py [--hops 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from clef_vllm.server.service import CpuPool


def nothing() -> int:
    return 1


async def measure(hops: int, workers: int) -> dict:
    pool = CpuPool(workers, inline_bytes=0)            # every job through the pool
    try:
        for _ in range(200):
            await pool.run(None, nothing)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(hops):
            await pool.run(None, nothing)
        alone = ((time.process_time() - cpu) / hops * 1e6, (time.perf_counter() - wall) / hops * 1e6)
        per_client = max(1, hops // 64)

        async def client():
            for _ in range(per_client):
                await pool.run(None, nothing)

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client() for _ in range(64)))
        n = 64 * per_client
        interleaved = ((time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6)
    finally:
        pool.close()
    return {"alone_us": [round(x, 1) for x in alone], "interleaved_64_us": [round(x, 1) for x in interleaved]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hops", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=2, help="pool threads [2: the server's default on 2 cores]")
    a = ap.parse_args(argv)
    r = asyncio.run(measure(a.hops, a.workers))
    print(f"one hop to the CPU pool and back, {a.workers} workers: one at a time {r['alone_us'][0]} us CPU / "
          f"{r['alone_us'][1]} us wall; 64 interleaved {r['interleaved_64_us'][0]} us CPU / "
          f"{r['interleaved_64_us'][1]} us wall per hop")
    return 0


if __name__ == "__main__":
    sys.exit(main())

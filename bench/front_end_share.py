"""How much of a closed-loop throughput gap to an in-process engine is the HTTP front-end's (CPU only).

clef-bench compares the server with raw vLLM driven *in process*: c clients, each sending its next
request as soon as the last one is answered. A server's client also waits for what the server does
around the engine (HTTP, parse, encode, answers), and during that time its request is not in the
engine, so the engine's steps hold fewer requests. This script measures that share with a stand-in
engine that batches by step like vLLM (``bench/instant_server.py``'s :class:`SteppedEngine`: a step
takes every waiting request and lasts F ms + P µs per token), once behind the real ``clef-systemone``
app and clef-bench, once driven directly by c closed-loop clients with the same token counts.

    python bench/front_end_share.py CKPT [--step-ms 3 --per-token-us 25] [-c 1 16 64] [-n 256] [-o OUT.json]

CKPT: any checkpoint folder (its tokenizer). Prints, per concurrency, both req/s, their ratio, how
many requests a step took on each side (warm-up requests included on the server's), and the server's
stages (``Server-Timing``); the JSON keeps it all with the settings. The defaults model the
9B on one H200 (a 16k-token step ~409 ms of GPU work: ~25 µs per token; steps begin ~3 ms apart).

Each side's req/s counts its start (c requests at once to an idle engine) and its drain (the last answers);
``steady`` is each side's throughput by Little's law instead, c over its mean latency (as ``clef-bench
--versus`` reports per time block), and ``steady_ratio`` the server's over the direct drive's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from instant_server import SteppedEngine

from clef_vllm.testing.server import LiveServer


async def engine_only(engine: SteppedEngine, concurrency: int, tokens: list[int], submit_ms: float = 0.0) -> dict:
    """``concurrency`` clients send ``tokens`` (one request each, in order) straight to ``engine``. With
    ``submit_ms``, handing a request to the engine holds one shared host for that long first (a stand-in
    for AsyncLLM's input processing, one request after another on its event loop)."""
    queue = list(reversed(tokens))
    latencies: list[float] = []
    host = asyncio.Lock()

    async def client():
        while queue:
            n = queue.pop()
            t0 = time.perf_counter()
            if submit_ms:
                async with host:
                    await asyncio.sleep(submit_ms / 1000)
            await engine.run(n)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"requests": len(latencies), "req_per_s": round(len(latencies) / wall, 2),
            "p50_ms": round(statistics.median(latencies) * 1000, 2),
            "steady_req_per_s": round(concurrency / statistics.mean(latencies), 2)}


def bench_point(url: str, checkpoint: str, workload: str, concurrency: int, requests: int, out: Path,
                warmup: int = 4) -> dict:
    """One clef-bench run against ``url`` at one concurrency; its single point (clef-bench's JSON)."""
    cmd = ["clef-bench", url, "--tokenizer", checkpoint, "--workload", workload, "-c", str(concurrency),
           "-n", str(requests), "--warmup", str(warmup), "--no-progress", "--time-limit", "600", "-o", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (point,) = json.loads(out.read_text())["points"]
    return point


def save(path: str | None, args: argparse.Namespace, points: list) -> None:
    """The results as JSON (settings, cores, points), when ``path`` is given."""
    if path:
        Path(path).write_text(json.dumps({"settings": vars(args), "cpus": os.cpu_count(), "points": points},
                                         indent=1) + "\n")


def steps_taken(server: LiveServer) -> dict[int, int]:
    """The stepped server's steps so far, by how many requests each took (its ``/v1/models``)."""
    status, text = server.call("/v1/models")
    if status != 200:
        raise SystemExit(f"the stepped server's /v1/models answered {status}: {text[:300]}")
    return {int(k): v for k, v in json.loads(text)["data"][0]["requests_per_step"].items()}


def mean_per_step(requests_per_step: dict[int, int]) -> float:
    steps = sum(requests_per_step.values())
    return round(sum(k * v for k, v in requests_per_step.items()) / steps, 2) if steps else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--step-ms", type=float, default=3.0)
    ap.add_argument("--per-token-us", type=float, default=25.0)
    ap.add_argument("--step-tokens", type=int, default=16384)
    ap.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("-n", "--num-requests", type=int, default=256, help="requests per point [256]")
    ap.add_argument("--workload", default="short")
    ap.add_argument("--direct-submit-ms", type=float, default=0.0,
                    help="driven directly, each request first holds one shared host this long (AsyncLLM's input "
                         "processing; raw vLLM in process) [0]")
    ap.add_argument("-o", "--out", help="write the results here (JSON)")
    a = ap.parse_args(argv)

    server = LiveServer([], ready_timeout=120, command=lambda port: [
        sys.executable, str(Path(__file__).with_name("instant_server.py")), a.checkpoint, str(port),
        "--step-ms", str(a.step_ms), "--per-token-us", str(a.per_token_us), "--step-tokens", str(a.step_tokens)])
    points = []
    try:
        server.wait_ready()
        with tempfile.TemporaryDirectory() as tmp:
            for c in a.concurrency:                  # one clef-bench run per point: the steps of each point apart
                before = steps_taken(server)
                point = bench_point(server.url, a.checkpoint, a.workload, c, a.num_requests, Path(tmp) / f"server_c{c}.json")
                after = steps_taken(server)
                points.append((point, {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}))
    finally:
        server.stop(timeout=30)

    rows = []
    for point, server_steps in points:
        c, tokens_per_request = point["concurrency"], point["input_tokens"]["mean_expected"]
        engine = SteppedEngine(a.step_ms, a.per_token_us, a.step_tokens)
        direct = asyncio.run(engine_only(engine, c, [round(tokens_per_request)] * point["ok"], a.direct_submit_ms))
        steady = c * 1000 / point["latency_ms"]["mean"]      # Little's law: c over the mean latency (no start or drain)
        rows.append({"concurrency": c, "tokens_per_request": round(tokens_per_request, 1),
                     "server_req_per_s": round(point["req_per_s"], 2), "server_p50_ms": point["latency_ms"]["p50"],
                     "engine_only_req_per_s": direct["req_per_s"], "engine_only_p50_ms": direct["p50_ms"],
                     "ratio": round(point["req_per_s"] / direct["req_per_s"], 3),
                     "server_steady_req_per_s": round(steady, 2),
                     "engine_only_steady_req_per_s": direct["steady_req_per_s"],
                     "steady_ratio": round(steady / direct["steady_req_per_s"], 3),
                     "server_stages_p50_ms": point.get("server_stages_p50_ms"),
                     "server_requests_per_step": mean_per_step(server_steps),
                     "engine_only_requests_per_step": mean_per_step(engine.requests_per_step)})
    print(f"stand-in engine: steps of {a.step_ms} ms + {a.per_token_us} µs per token (at most {a.step_tokens} "
          f"tokens); {a.workload}, {a.num_requests} requests a point; driven directly, {a.direct_submit_ms:g} ms of shared host per submission")
    print(" c  server req/s  engine-only req/s  ratio  steady ratio  requests a step (server / engine-only)  server p50 ms"
          "  engine-only p50 ms  server stages p50 ms")
    for r in rows:
        stages = ", ".join(f"{k} {v}" for k, v in (r["server_stages_p50_ms"] or {}).items())
        per_step = f"{r['server_requests_per_step']:.1f} / {r['engine_only_requests_per_step']:.1f}"
        print(f"{r['concurrency']:2d}  {r['server_req_per_s']:12.1f}  {r['engine_only_req_per_s']:17.1f}  "
              f"{r['ratio']:5.3f}  {r['steady_ratio']:12.3f}  {per_step:>38}  {r['server_p50_ms']:13.1f}  "
              f"{r['engine_only_p50_ms']:18.1f}  "
              f"{stages}")
    save(a.out, a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

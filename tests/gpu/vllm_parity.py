"""GPU check (issue 3a/3b): the vLLM backend against the reference backend on the same GPU.

For each layout (release, repacked) of a tiny checkpoint built on the spot:
  * N generated requests (varied states up to ~3k tokens, 1-6 questions, all types) go through
    ``Clef(backend="vllm")`` with a small ``max_num_batched_tokens`` so long prompts are split by
    chunked prefill, and through ``Clef(backend="reference", device="cuda")``;
  * token ids must be identical (the vLLM backend also checks vLLM's echo of them per request);
  * top answers are compared (a flip is excused only as a near-tie: reference top-2 margin below
    2·max|Δp|), and max / mean |Δp| reported.
Then the HTTP server (vLLM backend, DP=``--dp``) is loaded with concurrent requests and every
response is checked against the offline vLLM answer of the same request.

Usage (GPU machine, vLLM on PYTHONPATH):
    python tests/gpu/vllm_parity.py --out $OUT --n 240 [--dp 2] [--skip-parity] [--head-graph-records 1]
        [--prefill-graph-scope step]

``--head-graph-records`` (default: the server's, 16): the vLLM engines graph the joint head of steps
finishing up to that many requests (its batches finish many per step, so the default checks the
several-record graphs on every layout; 1 graphs one-request steps only). Other than the default it
names the result file ``..._rN.json``. ``--prefill-graph-scope`` (default: the server's) likewise names it
``..._SCOPE.json`` when it is not the default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from clef_vllm.backends.options import VllmOptions
from clef_vllm.bench.loadgen import distribution_ms
from clef_vllm.contract import HEAD_GRAPH_RECORDS, PREFILL_GRAPH_SCOPES
from clef_vllm.testing.server import LiveServer


def top_answers(response: dict) -> dict:
    out = {}
    for qid, a in response["answers"].items():
        if a["type"] == "noul":
            out[qid] = a["noul"] >= 0.5
        elif a["type"] == "choice":
            out[qid] = a["choice"]
        else:
            probs = a["probabilities"]
            out[qid] = max(probs, key=lambda k: probs[k])
    return out


def probability_vectors(response: dict) -> dict:
    out = {}
    for qid, a in response["answers"].items():
        out[qid] = [a["noul"], 1 - a["noul"]] if a["type"] == "noul" else list(a["probabilities"].values())
    return out


def compare(ref: list[dict], other: list[dict]) -> dict:
    """Top-answer agreement, |Δp| and flips (with the reference's top-2 margin)."""
    deltas, flips, total = [], [], 0
    for i, (a, b) in enumerate(zip(ref, other)):
        pa, pb = probability_vectors(a), probability_vectors(b)
        ta, tb = top_answers(a), top_answers(b)
        for qid in pa:
            total += 1
            d = max(abs(x - y) for x, y in zip(pa[qid], pb[qid]))
            deltas.append(d)
            if ta[qid] != tb[qid]:
                s = sorted(pa[qid], reverse=True)
                flips.append({"request": i, "question": qid, "ref": ta[qid], "other": tb[qid],
                              "ref_margin": round(s[0] - s[1], 5), "max_dp": round(d, 5)})
    max_dp = max(deltas) if deltas else 0.0
    true_flips = [f for f in flips if f["ref_margin"] >= 2 * max_dp]
    return {"questions": total, "top_agreement": 1 - len(flips) / max(total, 1), "flips": flips,
            "flips_not_near_ties": len(true_flips), "max_abs_dp": max_dp,
            "mean_abs_dp": sum(deltas) / max(len(deltas), 1)}


def parity(layout: str, n: int, workdir: Path, engine: dict) -> dict:
    import torch

    from clef_vllm import Clef
    from clef_vllm.bench.workloads import synthetic_parity_set
    from clef_vllm.model.tiny import build_tiny_checkpoint
    from clef_vllm.schema.dialects import parse_request

    ckpt = build_tiny_checkpoint(workdir / f"tiny-{layout}", layout=layout, mtp=True)
    bodies = synthetic_parity_set(n, seed=11, max_words=1500)
    t0 = time.perf_counter()
    with Clef(ckpt, backend="vllm", **engine) as vl:
        t_start = time.perf_counter() - t0
        encoded = [vl.backend.encoder.encode(parse_request(b))
                   for b in bodies]
        t1 = time.perf_counter()
        got = vl.systemone_batch(bodies)
        t_vllm = time.perf_counter() - t1
    with Clef(ckpt, backend="reference", device="cuda") as ref:
        ref_encoded = [ref.backend.encoder.encode(parse_request(b))
                       for b in bodies]
        t2 = time.perf_counter()
        want = ref.systemone_batch(bodies)
        t_ref = time.perf_counter() - t2
    same_ids = sum(a.input_ids == b.input_ids for a, b in zip(encoded, ref_encoded))
    lengths = [e.num_tokens for e in encoded]
    report = {"layout": layout, "requests": n, "token_ids_identical": same_ids,
              "tokens": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths),
                         "chunked": sum(x > engine["max_num_batched_tokens"] for x in lengths)},
              "engine_start_s": round(t_start, 1), "vllm_batch_s": round(t_vllm, 2), "reference_batch_s": round(t_ref, 2),
              "gpu": torch.cuda.get_device_name(0), **compare(want, got)}
    return report


async def http_load(url: str, bodies: list[dict], concurrency: int) -> tuple[list, dict]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    results: list = [None] * len(bodies)
    latencies: list[float] = []
    status: dict[int, int] = {}

    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i, body):
            async with sem:
                t = time.perf_counter()
                r = await client.post(url + "/v1/systemone", json=body)
                latencies.append(time.perf_counter() - t)
                status[r.status_code] = status.get(r.status_code, 0) + 1
                results[i] = r.json() if r.status_code == 200 else None

        t0 = time.perf_counter()
        await asyncio.gather(*[one(i, b) for i, b in enumerate(bodies)])
        wall = time.perf_counter() - t0
    return results, {"requests": len(bodies), "concurrency": concurrency, "wall_s": round(wall, 2),
                     "req_per_s": round(len(bodies) / wall, 1), "latency_ms": distribution_ms(latencies),
                     "status": status}


def server_load(workdir: Path, dp: int, n: int, engine: dict, log_dir: Path, engines_per_gpu: int = 1) -> dict:
    from clef_vllm import Clef
    from clef_vllm.bench.workloads import synthetic_parity_set
    from clef_vllm.model.tiny import build_tiny_checkpoint

    ckpt = workdir / "tiny-release"
    if not ckpt.exists():
        build_tiny_checkpoint(ckpt, mtp=True)
    bodies = synthetic_parity_set(n, seed=23, max_words=600)
    server = LiveServer(["--model", str(ckpt), "--backend", "vllm", "--dp", str(dp), "--gpu-memory-utilization",
                         str(engine["gpu_memory_utilization"]), "--max-num-seqs", "64",
                         "--engines-per-gpu", str(engines_per_gpu)], ready_timeout=420,
                        port=8731, log_path=log_dir / f"server_dp{dp}.log")
    report: dict = {"dp": dp, "engines_per_gpu": engines_per_gpu}
    try:
        import httpx

        t0 = time.perf_counter()
        server.wait_ready(poll_s=1.0)
        report["ready_s"] = round(time.perf_counter() - t0, 1)
        report["models"] = httpx.get(f"{server.url}/v1/models").json()
        for conc in (1, 16, 64):
            sub = bodies if conc > 1 else bodies[:32]
            got, stats = asyncio.run(http_load(server.url, sub, conc))
            report[f"c{conc}"] = stats
            if conc == 64:
                served = got
        # every response checked against its own request answered offline (no cross-talk)
        server.stop(timeout=60)
        with Clef(ckpt, backend="vllm", gpu_memory_utilization=engine["gpu_memory_utilization"]) as offline:
            want = offline.systemone_batch(bodies)
        report["vs_offline"] = {k: v for k, v in compare(want, [g or want[i] for i, g in enumerate(served)]).items()
                                if k != "flips"}
        report["missing_responses"] = sum(g is None for g in served)
        report["model_echo_ok"] = all(g is None or g["model"] == b["model"] for g, b in zip(served, bodies))
    finally:
        server.stop(timeout=60)
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--n", type=int, default=240)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--engines-per-gpu", type=int, default=1, help="engines sharing each GPU (--engines-per-gpu)")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-server", action="store_true")
    records_default = VllmOptions().head_graph_records
    ap.add_argument("--head-graph-records", type=int, default=records_default, choices=HEAD_GRAPH_RECORDS)
    scope_default = VllmOptions().resolved_prefill_graph_scope
    ap.add_argument("--prefill-graph-scope", default=scope_default, choices=PREFILL_GRAPH_SCOPES)
    ap.add_argument("--async-scheduling", action="store_true", help="vLLM's async scheduling (--async-scheduling on)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = dict(gpu_memory_utilization=0.35, max_num_batched_tokens=512, max_num_seqs=32,
                  head_graph_records=args.head_graph_records, prefill_graph_scope=args.prefill_graph_scope,
                  async_scheduling=args.async_scheduling)
    workdir = Path(tempfile.mkdtemp(prefix="clef-gpu-"))
    results = {}
    if not args.skip_parity:
        for layout in ("release", "repacked"):
            results[layout] = parity(layout, args.n, workdir, engine)
            print(json.dumps({k: v for k, v in results[layout].items() if k != "flips"}), flush=True)
    if not args.skip_server:
        results[f"server_dp{args.dp}"] = server_load(workdir, args.dp, 256, engine, out, args.engines_per_gpu)
        print(json.dumps(results[f"server_dp{args.dp}"]), flush=True)
    suffix = f"_r{args.head_graph_records}" if args.head_graph_records != records_default else ""
    suffix += f"_{args.prefill_graph_scope}" if args.prefill_graph_scope != scope_default else ""
    suffix += "_async" if args.async_scheduling else ""
    suffix += f"_{args.engines_per_gpu}pergpu" if args.engines_per_gpu > 1 else ""
    results["head_graph_records"] = args.head_graph_records
    results["prefill_graph_scope"] = args.prefill_graph_scope
    results["async_scheduling"] = args.async_scheduling
    (out / f"vllm_parity_dp{args.dp}{suffix}.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

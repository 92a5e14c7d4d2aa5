"""Soak: hold a clef-systemone server at saturation for a while; check every response against its
own request; track the server's memory (RSS of its process tree, GPU memory when nvidia-smi is
there); write a summary JSON. Exit status 1 if any response was lost or did not match.

Each request carries a unique marker in ``model`` and in every question id, so a response that
belongs to another request (or is missing a question, reorders them, or swaps option keys) is
caught. With ``--tokenizer`` the client encodes every request itself and checks
``usage.input_tokens`` exactly. A small share of requests is invalid on purpose (their 422 is
checked) and a small share goes through ``POST /v1/systemone/bulk`` (each line checked).
Refusals (429) are counted and retried, never counted as lost.

    # against a running server (its pid for RSS)
    python bench/soak.py --url http://127.0.0.1:8000 --pid 1234 --duration 1800 --out soak.json
    # or start one (GPU: --backend vllm; CPU: --backend reference) and stop it with SIGTERM at the end
    python bench/soak.py --launch --duration 600 --out soak.json -- --model CKPT --backend vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from clef_vllm.bench.loadgen import distribution_ms
from clef_vllm.testing.server import LiveServer

WORDS = ("checkout payment refund invoice outage login error customer urgent billing shipping delivery account "
         "password email server database network latency crash timeout upgrade cancel plan price sales "
         "support ticket escalate resolved pending failed success warning alert incident severity priority "
         "café naïve Ünïcödé 日本語 ☕ 🎉").split()


# --------------------------------------------------------------------------- workload


def make_request(rng: random.Random, marker: str, invalid: bool = False) -> tuple[dict, dict]:
    """A request whose model and question ids carry ``marker``, and what its response must look like."""
    questions, expect = {}, {}
    for k in range(rng.randint(1, 8)):
        kind = rng.choice(("noul", "choice", "score"))
        qid = f"{kind}_{k}_{marker}"
        if kind == "noul":
            questions[qid] = {"type": "noul", "instructions": f"Is it {rng.choice(WORDS)}?"}
            expect[qid] = ("noul", None)
        elif kind == "choice":
            options = rng.sample(WORDS, rng.randint(2, 6))
            questions[qid] = {"type": "choice", "instructions": "Which one?",
                              "criteria": {o: f"about {o}" for o in options}}
            expect[qid] = ("choice", options)
        else:
            levels = [f"level {i}" for i in range(rng.randint(2, 6))]
            questions[qid] = {"type": "score", "instructions": "How much?", "criteria": levels}
            expect[qid] = ("score", levels)
    state = " ".join(rng.choice(WORDS) for _ in range(rng.choice((5, 40, 150, 400))))
    if rng.random() < 0.3:
        state = {"ticket": marker, "text": state, "n": rng.randint(0, 10 ** 12), "tags": rng.sample(WORDS, 3)}
    body = {"model": f"soak-{marker}", "state": state, "questions": questions}
    if invalid:
        body["questions"] = {f"bad_{marker}": {"type": "choice", "criteria": {}}}   # 422: empty criteria
    return body, expect


def check_response(body: dict, expect: dict, request: dict, encoder=None) -> str | None:
    """``None`` if the response belongs to ``request`` and is well formed, else what is wrong."""
    if body.get("model") != request["model"]:
        return f"model {body.get('model')!r} != {request['model']!r}"
    answers = body.get("answers", {})
    if list(answers) != list(expect):
        return f"answer keys {list(answers)[:3]}... != request order"
    for qid, (kind, options) in expect.items():
        a = answers[qid]
        if a.get("type") != kind:
            return f"{qid}: type {a.get('type')} != {kind}"
        if kind == "noul":
            if not 0.0 <= a["noul"] <= 1.0:
                return f"{qid}: noul {a['noul']} out of [0, 1]"
            continue
        probs = a["probabilities"]
        keys = options if kind == "choice" else [str(i) for i in range(len(options))]
        if list(probs) != keys:
            return f"{qid}: probability keys {list(probs)} != {keys}"
        if abs(sum(probs.values()) - 1.0) > 1e-4 * len(keys) + 1e-3:
            return f"{qid}: probabilities sum to {sum(probs.values())}"
        if kind == "choice" and a["choice"] not in options:
            return f"{qid}: choice {a['choice']!r} is not an option"
        if kind == "score" and (a["legend"] != {str(i): v for i, v in enumerate(options)}
                                or not 0.0 <= a["score"] <= len(options) - 1):
            return f"{qid}: legend or score wrong"
    usage = body.get("usage", {})
    if usage.get("output_tokens") != 0 or not usage.get("input_tokens", 0) > 0:
        return f"usage {usage}"
    if encoder is not None:
        from clef_vllm.protocol import parse_request

        want = encoder.encode(parse_request(request)).num_tokens
        if usage["input_tokens"] != want:
            return f"usage.input_tokens {usage['input_tokens']} != {want} encoded locally"
    return None


# --------------------------------------------------------------------------- memory


class MemorySampler:
    """RSS of a process and its children (vLLM engine cores), GPU memory used (nvidia-smi)."""

    def __init__(self, pid: int | None):
        self.series: list[tuple[float, float | None, float | None]] = []
        self.proc = None
        if pid:
            import psutil

            self.proc = psutil.Process(pid)
        self.gpu = self._gpu_mb() is not None

    def _rss_mb(self) -> float | None:
        if self.proc is None:
            return None
        import psutil

        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            return None
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2 ** 20

    @staticmethod
    def _gpu_mb() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
            return float(sum(int(x) for x in out.stdout.split())) if out.returncode == 0 else None
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def sample(self, t: float) -> None:
        self.series.append((round(t, 1), self._rss_mb(), self._gpu_mb() if self.gpu else None))

    def summary(self, column: int, warmup_share: float = 0.1, window_s: float = 60.0) -> dict | None:
        """Memory over time. Samples land inside or between batches, so a single sample swings by
        the working memory of a batch; the trend is judged on per-window floors (the lowest sample
        of each ``window_s``: what stays allocated) and peaks, after a warm-up share."""
        values = [(t, v) for t, v in ((s[0], s[column]) for s in self.series) if v is not None]
        if not values:
            return None
        steady = values[int(len(values) * warmup_share):] or values
        windows: dict[int, list[float]] = {}
        for t, v in steady:
            windows.setdefault(int(t // window_s), []).append(v)
        full = max(len(w) for w in windows.values())
        kept = [w for _, w in sorted(windows.items()) if len(w) * 2 >= full] or list(windows.values())
        floors = [round(min(w), 1) for w in kept]                  # partial windows (the run's end) dropped
        peaks = [round(max(w), 1) for w in kept]
        k = max(1, len(floors) // 4)
        floor_start, floor_end = statistics.median(floors[:k]), statistics.median(floors[-k:])
        growth = floor_end - floor_start
        slope = 0.0
        if len(steady) >= 3 and steady[-1][0] > steady[0][0]:
            ts, vs = [t for t, _ in steady], [v for _, v in steady]
            mt, mv = statistics.fmean(ts), statistics.fmean(vs)
            var = sum((t - mt) ** 2 for t in ts)
            slope = sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / var * 3600 if var else 0.0
        return {"samples": len(values), "first": round(values[0][1], 1), "last": round(values[-1][1], 1),
                "max": round(max(v for _, v in values), 1), "window_s": window_s,
                "floor_per_window": floors, "peak_per_window": peaks,
                "floor_start": round(floor_start, 1), "floor_end": round(floor_end, 1),
                "floor_growth_mb": round(growth, 1),
                "floor_growth_pct": round(100 * growth / floor_start, 2) if floor_start else None,
                "slope_all_samples_mb_per_h": round(slope, 1),
                "flat": growth <= max(50.0, 0.05 * floor_start)}


# --------------------------------------------------------------------------- driver


class Soak:
    def __init__(self, args, encoder=None):
        self.args = args
        self.encoder = encoder
        self.run_id = f"{int(time.time()) % 100000:05d}"
        self.seq = 0
        self.counts = {"sent": 0, "ok": 0, "expected_errors": 0, "mismatched": 0, "lost": 0, "refused_429": 0}
        self.bulk = {"streams": 0, "records": 0, "ok": 0, "mismatched": 0, "lost": 0}
        self.errors: dict[str, int] = {}
        self.examples: list[dict] = []
        self.latencies: list[float] = []
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def _marker(self) -> str:
        self.seq += 1
        return f"{self.run_id}x{self.seq}"

    def _bad(self, kind: str, what: str, count: bool = True, **extra) -> None:
        if count:
            self.counts[kind] += 1
        if len(self.examples) < 20:
            self.examples.append({"kind": kind, "what": what, **extra})

    async def single(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        marker = self._marker()
        invalid = rng.random() < self.args.invalid_share
        body, expect = make_request(rng, marker, invalid)
        rid = f"soak-{marker}"
        while True:
            self.counts["sent"] += 1
            t0 = time.perf_counter()
            try:
                resp = await client.post("/v1/systemone", json=body, headers={**self.headers, "X-Request-Id": rid})
            except httpx.HTTPError as exc:
                self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
                self._bad("lost", f"{type(exc).__name__}: {exc}", marker=marker)
                return
            if resp.status_code == 429:
                self.counts["refused_429"] += 1
                await asyncio.sleep(min(float(resp.headers.get("retry-after", "1")), 2.0) * rng.random())
                continue
            break
        self.latencies.append(time.perf_counter() - t0)
        if resp.headers.get("x-request-id") != rid:
            self._bad("mismatched", f"x-request-id {resp.headers.get('x-request-id')} != {rid}", marker=marker)
            return
        if invalid:
            if resp.status_code == 422 and f"bad_{marker}" in resp.text:
                self.counts["expected_errors"] += 1
            else:
                self._bad("mismatched", f"invalid request answered {resp.status_code}", marker=marker)
            return
        if resp.status_code != 200:
            self.errors[str(resp.status_code)] = self.errors.get(str(resp.status_code), 0) + 1
            self._bad("lost", f"HTTP {resp.status_code}: {resp.text[:200]}", marker=marker)
            return
        problem = check_response(resp.json(), expect, body, self.encoder)
        if problem:
            self._bad("mismatched", problem, marker=marker)
        else:
            self.counts["ok"] += 1

    async def bulk_stream(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        items = [make_request(rng, self._marker()) for _ in range(rng.randint(2, 6))]
        payload = "".join(json.dumps(b) + "\n" for b, _ in items)
        self.bulk["streams"] += 1
        self.bulk["records"] += len(items)
        try:
            resp = await client.post("/v1/systemone/bulk", content=payload,
                                     headers={**self.headers, "Content-Type": "application/x-ndjson"})
        except httpx.HTTPError as exc:
            self.bulk["lost"] += len(items)
            self._bad("lost", f"bulk stream {type(exc).__name__}: {exc}", count=False)
            return
        if resp.status_code == 429:
            self.bulk["records"] -= len(items)
            self.bulk["streams"] -= 1
            self.counts["refused_429"] += 1
            return
        lines = [json.loads(x) for x in resp.content.split(b"\n") if x.strip()]
        seen = set()
        for line in lines[:-1]:
            i = line.get("index")
            if i is None or not 0 <= i < len(items) or i in seen:
                self.bulk["mismatched"] += 1
                continue
            seen.add(i)
            body, expect = items[i]
            problem = "status %s" % line["status"] if line["status"] != 200 else check_response(
                line["body"], expect, body, self.encoder)
            if problem:
                self.bulk["mismatched"] += 1
                self._bad("mismatched", f"bulk line {i}: {problem}", count=False)
            else:
                self.bulk["ok"] += 1
        self.bulk["lost"] += len(items) - len(seen)
        if not lines or lines[-1].get("summary", {}).get("records") != len(items):
            self.bulk["mismatched"] += 1
            self._bad("mismatched", f"bulk summary {lines[-1] if lines else None}", count=False)

    async def worker(self, client: httpx.AsyncClient, deadline: float, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            if rng.random() < self.args.bulk_share:
                await self.bulk_stream(client, rng)
            else:
                await self.single(client, rng)

    async def run(self, sampler: MemorySampler) -> float:
        limits = httpx.Limits(max_connections=self.args.concurrency + 4, max_keepalive_connections=self.args.concurrency)
        async with httpx.AsyncClient(base_url=self.args.url, timeout=self.args.client_timeout, limits=limits) as client:
            t0 = time.monotonic()
            deadline = t0 + self.args.duration

            async def sample_loop():
                while True:
                    sampler.sample(time.monotonic() - t0)
                    await asyncio.sleep(self.args.sample_every)

            sampling = asyncio.create_task(sample_loop())
            await asyncio.gather(*(self.worker(client, deadline, self.args.seed + i)
                                   for i in range(self.args.concurrency)))
            sampling.cancel()
            elapsed = time.monotonic() - t0
            sampler.sample(elapsed)
            return elapsed


def scrape(url: str, headers: dict) -> dict[str, float]:
    """Selected /metrics values (sums over label sets)."""
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{")[0]
        key = name
        if name == "clef_requests_total" and 'route="/v1/systemone"' in name_labels:
            key = "systemone_" + name_labels.split('status="')[1].split('"')[0]
        elif name == "clef_requests_total":
            continue
        if name in ("clef_requests_total", "clef_bulk_records_total", "clef_truncations_total", "clef_answers_total",
                    "clef_near_ties_total", "clef_batch_size_count", "clef_batch_size_sum", "clef_max_in_flight",
                    "clef_max_queue", "clef_engine_failures_total", "clef_engine_cancellations_total"):
            out[key] = out.get(key, 0.0) + float(value)
    return out


def launch(server_args: list[str], log_path: Path, ready_timeout: float) -> LiveServer:
    try:
        return LiveServer(server_args, ready_timeout=ready_timeout, log_path=log_path).wait_ready(poll_s=0.5)
    except (RuntimeError, TimeoutError) as exc:
        raise SystemExit(f"{str(exc).splitlines()[0]}; see {log_path}") from None


def main(argv: list[str] | None = None) -> int:
    command = " ".join(["python", "bench/soak.py", *(sys.argv[1:] if argv is None else argv)])
    argv = sys.argv[1:] if argv is None else argv
    server_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, server_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else --launch)")
    p.add_argument("--launch", action="store_true", help="start clef-systemone with the arguments after --")
    p.add_argument("--pid", type=int, help="the server's pid, for RSS (set by --launch)")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds at saturation (default 1800)")
    p.add_argument("--concurrency", type=int, default=0,
                   help="clients; default 2 x the server's clef_max_in_flight (engine full, queue never empty)")
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between memory samples")
    p.add_argument("--invalid-share", type=float, default=0.03, help="share of requests that must get 422")
    p.add_argument("--bulk-share", type=float, default=0.03, help="share of iterations sent as a bulk stream")
    p.add_argument("--tokenizer", help="checkpoint folder: check usage.input_tokens exactly against local encoding")
    p.add_argument("--max-model-len", type=int, default=16384, help="the server's --max-model-len (with --tokenizer)")
    p.add_argument("--api-key", default=os.environ.get("CLEF_API_KEY"))
    p.add_argument("--client-timeout", type=float, default=600.0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="free text stored in the summary (e.g. 'CPU reference, tiny')")
    p.add_argument("--out", required=True, help="summary JSON path")
    p.add_argument("--fail-on-memory", action="store_true", help="exit 1 when memory is not flat")
    p.add_argument("--server-log", help="with --launch: where the server's output goes (default: a temp folder)")
    args = p.parse_args(argv)
    if not args.url and not args.launch:
        p.error("give --url or --launch")

    proc = None
    log_path = Path(args.server_log) if args.server_log else Path(tempfile.mkdtemp(prefix="clef-soak-")) / "server.log"
    if args.launch:
        server = launch(server_args, log_path, args.ready_timeout)
        proc, args.url, args.pid = server.proc, server.url, server.pid
    args.url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    encoder = None
    if args.tokenizer:
        from clef_vllm.demo import resolve_model_dir
        from clef_vllm.encoding import RequestEncoder

        encoder = RequestEncoder.from_pretrained(resolve_model_dir(args.tokenizer), max_length=args.max_model_len)
    before = scrape(args.url, headers)
    if not args.concurrency:
        args.concurrency = max(2, int(2 * before.get("clef_max_in_flight", 16)))
    try:
        model_info = httpx.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    except (httpx.HTTPError, KeyError, ValueError):
        model_info = {}
    sampler = MemorySampler(args.pid)
    soak = Soak(args, encoder)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"soak: {args.url} for {args.duration:g} s at concurrency {args.concurrency}", flush=True)
    elapsed = asyncio.run(soak.run(sampler))
    after = scrape(args.url, headers)
    exit_code = None
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = "killed after 120 s"

    rss, gpu = sampler.summary(1), sampler.summary(2)
    failed = soak.counts["mismatched"] + soak.counts["lost"] + soak.bulk["mismatched"] + soak.bulk["lost"]
    memory_flat = all(m is None or m["flat"] for m in (rss, gpu))
    summary = {
        "label": args.label, "started_at": started, "url": args.url, "server": model_info,
        "duration_s": round(elapsed, 1), "concurrency": args.concurrency,
        "requests": {**soak.counts, "errors": soak.errors}, "bulk": soak.bulk,
        "answered_per_s": round((soak.counts["ok"] + soak.counts["expected_errors"] + soak.bulk["ok"]) / elapsed, 2),
        "latency_ms": distribution_ms(soak.latencies),
        "memory": {"rss_mb": rss, "gpu_mb": gpu, "series_t_rss_gpu": sampler.series},
        "server_metrics_delta": {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in sorted(after)},
        "input_tokens_checked_locally": encoder is not None,
        "server_exit_code": exit_code,
        "server_log": str(log_path) if proc is not None else None,
        "examples": soak.examples,
        "verdict": "pass" if failed == 0 and (memory_flat or not args.fail_on_memory) else "fail",
        "memory_flat": memory_flat,
        "command": command,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: summary[k] for k in ("requests", "bulk", "answered_per_s", "latency_ms", "memory_flat",
                                               "verdict")}, indent=1), flush=True)
    return 0 if summary["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())

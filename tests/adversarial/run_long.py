"""Adversarial long run (not in CI): the issue's worst cases at full size against real
``clef-systemone`` servers (default flags unless said), with the numbers the targets are stated in.
Writes a summary JSON.

The servers run the tiny checkpoint with the real Qwen3.5 tokenizer and the ``instant`` fault hook
(server/faults.py): everything a request costs the server except the engine (HTTP, limits,
decoding, validation, encoding, answers) is real and measured; the engine answers at once. On this
CPU the reference backbone alone takes ~40 s of CPU for any 16,384-token request, whatever its body:
that is the engine's price for the token budget, not what a body can add to it.

    python tests/adversarial/run_long.py --out bench/results/adversarial_cpu.json

Phases:

1. ``worst_cases``: each 16 MiB body alone (huge state array, ~1.3 M state keys, ~700k questions,
   ~1 M options, and a 16 MiB text state, which is answered): status, server CPU seconds (user +
   system of the server process), peak RSS above the RSS before (``VmHWM`` after resetting it
   through ``/proc/PID/clear_refs``), RSS 2 s after (memory handed back).
2. ``concurrent``: a normal request's latency alone, then again while 8 attackers each send a
   worst-case body every second (``concurrent``) or back to back (``concurrent_flood``), with
   ``GET /health/live`` probed every 20 ms meanwhile; attackers, prober and normal client each run
   in their own process.
3. ``slow_clients``: 4 bulk streams that send only their headers and 200 connections that send half
   a request head; meanwhile normal and bulk requests are timed; when each idle connection is
   answered (408) or closed.
4. ``d1``/``d2``: the nesting depths around the old recursion limit; 200 clients that send headers,
   one body byte, and close (499 ``client_closed``, never 500).
5. ``sigterm``: a server with ``--shutdown-timeout 5``, a stalled upload, a bulk stream that never
   sent a byte, one that stalled after its first record, a request that never leaves the engine
   (fault hook ``hold_dir``) and 4 clients sending requests in a loop; SIGTERM: exit status and
   time, every request answered (the stuck one with 503 at the timeout).

Pass: the targets in ``targets`` of the summary (0 responses >= 500, 0 tracebacks, ...).

Every hostile client at once beside a checked load, for as long as wanted, with memory, loop lag and
probes sampled every second: ``bench/soak.py --mix adversarial`` (its short form runs in CI).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

# run as a script: this folder is sys.path[0], so the attacks module imports as a top-level one
from attacks import MiB, WORST_CASES, connect, head, ndjson, read_response

from clef_vllm.bench.loadgen import percentile
from clef_vllm.testing.bodies import nested_level
from clef_vllm.testing.server import LiveServer, free_port

REQUEST = {"model": "clef-flash", "state": "Checkout has been failing for every customer for the last hour.",
           "questions": {"urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
                         "team": {"type": "choice", "criteria": {"billing": "Payments", "technical": "Outages"}}}}
JSON = {"Content-Type": "application/json"}


class Server(LiveServer):
    """The reference server on the tiny checkpoint, the engine answering at once (``instant``
    fault hook), plus the process numbers the report needs."""

    def __init__(self, ckpt: Path, work: Path, *args: str, env: dict | None = None):
        port = free_port()
        super().__init__(["--model", str(ckpt), "--backend", "reference", *args],
                         env={"CLEF_VLLM_FAULTS": "instant", **(env or {})}, ready_timeout=300, port=port,
                         log_path=work / f"server-{port}.log")
        self.wait_ready()
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def rss_mb(self) -> float:
        return self.ps.memory_info().rss / MiB

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def peak_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def stop(self, timeout: float = 120.0) -> int:
        return super().stop(timeout)


def post_raw(port: int, body: bytes, timeout: float = 120) -> tuple[int | None, bytes, float]:
    """One request on its own socket (a worst-case body is sent as fast as the kernel takes it)."""
    t0 = time.perf_counter()
    sock = connect(port, timeout)
    try:
        sock.sendall(head("/v1/systemone", port, content_length=len(body)) + body)
    except OSError:
        pass                                       # the server may refuse before reading it all
    status, _, text = read_response(sock, timeout)
    sock.close()
    return status, text, time.perf_counter() - t0


def normal(url: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    resp = httpx.post(url + "/v1/systemone", json=REQUEST, timeout=120)
    return resp.status_code, time.perf_counter() - t0


# --------------------------------------------------------------------------- phases


def phase_worst_cases(server: Server, size: int) -> dict:
    out = {}
    for name, build in WORST_CASES.items():
        body = build(size)
        normal(server.url)
        time.sleep(1.0)
        rss0, cpu0 = server.rss_mb(), server.cpu()
        server.reset_peak()
        status, text, wall = post_raw(server.port, body)
        cpu = server.cpu() - cpu0
        peak = server.peak_mb()
        time.sleep(2.0)
        message = json.loads(text).get("error", {}).get("message") if text.startswith(b"{") else None
        usage = json.loads(text).get("usage") if status == 200 else None
        out[name] = {"body_bytes": len(body), "status": status, "server_cpu_s": round(cpu, 3),
                     "wall_s": round(wall, 3), "rss_before_mb": round(rss0, 1),
                     "peak_rss_above_before_mb": round(peak - rss0, 1), "rss_2s_after_mb": round(server.rss_mb(), 1),
                     "message": message, "usage": usage}
        print(name, out[name], flush=True)
    return out


def _attacker(port: int, body: bytes, seconds: float, out, pace: float = 0.0) -> None:
    """Send ``body`` again and again (``pace``: at most one per that many seconds)."""
    deadline, statuses = time.monotonic() + seconds, {}
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        status, _, _ = post_raw(port, body)
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        time.sleep(max(0.0, pace - (time.monotonic() - t0)))
    out.put(("attacker", statuses))


def _prober(url: str, seconds: float, out) -> None:
    deadline, times = time.monotonic() + seconds, []
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            ok = client.get("/health/live").status_code == 200
            times.append(time.perf_counter() - t0 if ok else float("inf"))
            time.sleep(0.02)
    out.put(("probe", times))


def _normal_client(url: str, seconds: float, out) -> None:
    deadline, times, statuses = time.monotonic() + seconds, [], {}
    with httpx.Client(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            status = client.post("/v1/systemone", json=REQUEST).status_code
            times.append(time.perf_counter() - t0)
            statuses[str(status)] = statuses.get(str(status), 0) + 1
    out.put(("normal", (times, statuses)))


def phase_concurrent(server: Server, size: int, seconds: float, pace: float = 0.0) -> dict:
    """Attackers, the prober and the normal client each in their own process (no client-side GIL
    between them and the measurements). ``pace`` 0: each attacker sends its next body as soon as
    the last is answered (8 always in flight: a flood); else one body per ``pace`` seconds each."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    base_p: list[float] = []
    probe = ctx.Process(target=_prober, args=(server.url, 5.0, out))
    probe.start()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for _ in range(40):
            t0 = time.perf_counter()
            client.post("/v1/systemone", json=REQUEST)
            base_p.append(time.perf_counter() - t0)
    base_probe = out.get()[1]
    probe.join()
    bodies = [build(size) for name, build in WORST_CASES.items() if name != "state_text"]
    cpu0 = server.cpu()
    load0 = os.getloadavg()[0]
    procs = [ctx.Process(target=_attacker, args=(server.port, bodies[i % len(bodies)], seconds, out, pace))
             for i in range(8)]
    procs += [ctx.Process(target=_prober, args=(server.url, seconds, out)),
              ctx.Process(target=_normal_client, args=(server.url, seconds, out))]
    for proc in procs:
        proc.start()
    results = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
    attacks: dict[str, int] = {}
    probes, during, normal_statuses = [], [], {}
    for kind, value in results:
        if kind == "attacker":
            for k, v in value.items():
                attacks[k] = attacks.get(k, 0) + v
        elif kind == "probe":
            probes = value
        else:
            during, normal_statuses = value
    out_ = {"seconds": seconds, "attackers": 8, "pace_s": pace or "none (flood)",
            "machine_load_avg_1min": {"before": round(load0, 2), "after": round(os.getloadavg()[0], 2)},
            "worst_case_responses": attacks,
            "normal_responses": normal_statuses, "server_cpu_s": round(server.cpu() - cpu0, 1),
            "health_live_ms": {"alone_p99": ms(percentile(base_probe, 99)), "n": len(probes),
                               "p50": ms(percentile(probes, 50)), "p99": ms(percentile(probes, 99)),
                               "max": ms(max(probes) if probes else None)},
            "normal_request_ms": {"alone_p50": ms(statistics.median(base_p)), "during_p50": ms(percentile(during, 50)),
                                  "during_n": len(during)}}
    out_["normal_request_ms"]["ratio"] = round(out_["normal_request_ms"]["during_p50"]
                                               / out_["normal_request_ms"]["alone_p50"], 2)
    print("concurrent", out_, flush=True)
    return out_


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def phase_slow_clients(server: Server, header_timeout: float, body_timeout: float) -> dict:
    base = [normal(server.url)[1] for _ in range(20)]
    idle_bulk, slow_head = [], []
    t0 = time.monotonic()
    for _ in range(4):
        sock = connect(server.port, 60)
        sock.sendall(head("/v1/systemone/bulk", server.port, content_type="application/x-ndjson"))
        idle_bulk.append(sock)
    for _ in range(200):
        sock = connect(server.port, 60)
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n")
        slow_head.append(sock)
    during, bulk_statuses = [], {}
    while time.monotonic() - t0 < 5:
        during.append(normal(server.url)[1])
        resp = httpx.post(server.url + "/v1/systemone/bulk", content=ndjson([REQUEST, REQUEST]),
                          headers={"Content-Type": "application/x-ndjson"}, timeout=60)
        bulk_statuses[str(resp.status_code)] = bulk_statuses.get(str(resp.status_code), 0) + 1
    answered: dict[str, list] = {"idle_bulk": [], "slow_head": []}

    def wait_close(kind, sock):
        status, _, _ = read_response(sock, 60)
        answered[kind].append((status, time.monotonic() - t0))
        sock.close()

    with ThreadPoolExecutor(64) as pool:
        list(pool.map(lambda s: wait_close("idle_bulk", s), idle_bulk))
        list(pool.map(lambda s: wait_close("slow_head", s), slow_head))
    streams_after = [line for line in server.metrics().splitlines() if line.startswith("clef_bulk_streams ")]
    out = {"idle_bulk_connections": 4, "slow_header_connections": 200,
           "configured": {"header_timeout_s": header_timeout, "body_timeout_s": body_timeout},
           "normal_request_ms": {"alone_p50": ms(statistics.median(base)), "during_p50": ms(statistics.median(during)),
                                 "during_n": len(during)},
           "bulk_requests_meanwhile": bulk_statuses,
           "idle_bulk": {"statuses": sorted({str(s) for s, _ in answered["idle_bulk"]}),
                         "answered_after_s_max": round(max(t for _, t in answered["idle_bulk"]), 2)},
           "slow_head": {"statuses": sorted({str(s) for s, _ in answered["slow_head"]}),
                         "closed_after_s_max": round(max(t for _, t in answered["slow_head"]), 2)},
           "bulk_streams_gauge_after": streams_after}
    print("slow_clients", out, flush=True)
    return out


def phase_d1_d2(server: Server) -> dict:
    d1 = {}
    for depth in (961, 962, 963, 964, 965, 966, 2000):
        status, text, _ = post_raw(server.port, nested_level(depth))
        d1[str(depth)] = status
    before = server.metrics()
    for _ in range(200):
        sock = connect(server.port)
        sock.sendall(head("/v1/systemone", server.port, content_length=1000) + b"{")
        sock.close()
    time.sleep(3)
    after = server.metrics()

    def count(text, reason):
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("clef_requests_total") and f'reason="{reason}"' in line)
    out = {"d1_status_by_depth": d1, "d2_clients": 200,
           "d2_counted_499_client_closed": count(after, "client_closed") - count(before, "client_closed"),
           "d2_counted_internal": count(after, "internal") - count(before, "internal")}
    print("d1_d2", out, flush=True)
    return out


def phase_sigterm(ckpt: Path, work: Path, shutdown_timeout: float) -> dict:
    holds = work / "holds"
    holds.mkdir(exist_ok=True)
    server = Server(ckpt, work, "--shutdown-timeout", str(shutdown_timeout),
                    env={"CLEF_VLLM_FAULTS": f"instant,hold_dir={holds}"})
    stalled = connect(server.port, 60)
    stalled.sendall(head("/v1/systemone", server.port, content_length=5000) + b'{"model":"m",')
    silent_bulk = connect(server.port, 60)
    silent_bulk.sendall(head("/v1/systemone/bulk", server.port, content_type="application/x-ndjson"))
    started_bulk = connect(server.port, 60)
    started_bulk.sendall(head("/v1/systemone/bulk", server.port, content_type="application/x-ndjson"))
    line = json.dumps(REQUEST).encode() + b"\n"
    started_bulk.sendall(b"%x\r\n%s\r\n" % (len(line), line))
    stop = threading.Event()
    results: list[tuple[float, int | str]] = []

    def looper():
        with httpx.Client(base_url=server.url, timeout=60) as client:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    results.append((t0, client.post("/v1/systemone", json=REQUEST).status_code))
                except httpx.HTTPError as exc:
                    results.append((t0, type(exc).__name__))
                    return

    never = {"model": "m", "state": "x", "questions": {"hold.never": {"type": "noul"}}}   # stays in the engine

    def stuck():
        t0 = time.monotonic()
        resp = httpx.post(server.url + "/v1/systemone", json=never, timeout=120)
        return resp.status_code, resp.json()["error"]["message"] if resp.status_code != 200 else None, t0

    with ThreadPoolExecutor(8) as pool:
        loops = [pool.submit(looper) for _ in range(4)]
        held = pool.submit(stuck)
        time.sleep(3)
        t_signal = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        answers = {}
        for name, sock in (("stalled_upload", stalled), ("silent_bulk", silent_bulk), ("started_bulk", started_bulk)):
            status, _, text = read_response(sock, 30)
            answers[name] = {"status": status, "after_s": round(time.monotonic() - t_signal, 2),
                             "tail": text[-160:].decode("utf-8", "replace")}
        code = server.proc.wait(timeout=120)
        exited = time.monotonic() - t_signal
        stop.set()
        for f in loops:
            f.result()
        held_status, held_message, _ = held.result()
        answers["request_never_finishing"] = {"status": held_status, "message": held_message}
    before = [s for t, s in results if t < t_signal]
    after = [s for t, s in results if t >= t_signal]
    log = server.log()
    out = {"shutdown_timeout_s": shutdown_timeout, "exit_code": code, "exit_after_s": round(exited, 2),
           "stalled_clients": answers,
           "requests_sent_before_sigterm": {str(s): before.count(s) for s in set(before)},
           "requests_sent_after_sigterm": {str(s): after.count(s) for s in set(after)},
           "log_tracebacks": log.count("Traceback"), "log_errors": log.count(" ERROR ")}
    print("sigterm", out, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--size-mb", type=float, default=16.0, help="worst-case body size (default 16 MiB)")
    p.add_argument("--concurrent-seconds", type=float, default=30.0)
    args = p.parse_args()
    os.environ.setdefault("CLEF_VLLM_CACHE", str(Path(tempfile.gettempdir()) / "clef-vllm-cache"))
    import shutil

    from clef_vllm.model.tiny import build_tiny_checkpoint
    from clef_vllm.testing.qwen_tokenizer import cached_qwen35_tokenizer

    work = Path(tempfile.mkdtemp(prefix="clef-adversarial-"))
    ckpt = build_tiny_checkpoint(work / "tiny", mtp=True)
    for f in cached_qwen35_tokenizer(Path(os.environ["CLEF_VLLM_CACHE"])).iterdir():   # the real tokenizer
        shutil.copy(f, ckpt / f.name)
    size = int(args.size_mb * MiB) - 64
    started = time.time()
    server = Server(ckpt, work)
    summary = {"command": " ".join(["python", "tests/adversarial/run_long.py", *sys.argv[1:]]),
               "server": "clef-systemone --backend reference (other flags default) on the tiny checkpoint "
                         "with the Qwen3.5 tokenizer, CLEF_VLLM_FAULTS=instant (the engine answers at once), CPU",
               "machine": f"{os.cpu_count()} cores, shared (1-min load average at start: {os.getloadavg()[0]:.1f})",
               "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    summary["worst_cases"] = phase_worst_cases(server, size)
    summary["concurrent"] = phase_concurrent(server, size, args.concurrent_seconds, pace=1.0)
    summary["concurrent_flood"] = phase_concurrent(server, size, args.concurrent_seconds)
    summary["slow_clients"] = phase_slow_clients(server, 10.0, 10.0)
    summary["d1_d2"] = phase_d1_d2(server)
    metrics = server.metrics()
    code = server.stop()
    log = server.log()
    summary["main_server"] = {
        "exit_code": code, "log_tracebacks": log.count("Traceback"), "log_errors": log.count(" ERROR "),
        "responses_ge_500": sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                if line.startswith(("clef_requests_total", "clef_bulk_records_total"))
                                and 'status="5' in line)}
    summary["sigterm"] = phase_sigterm(ckpt, work, 5.0)
    summary["duration_s"] = round(time.time() - started, 1)
    wc, cc, sc, sg = summary["worst_cases"], summary["concurrent"], summary["slow_clients"], summary["sigterm"]
    targets = {
        "worst_cases_rejected_or_answered": all(v["status"] in (200, 413) for v in wc.values()),
        "worst_cases_cpu_le_2s": all(v["server_cpu_s"] <= 2.0 for v in wc.values()),
        "worst_cases_peak_rss_le_300mb": all(v["peak_rss_above_before_mb"] <= 300 for v in wc.values()),
        "health_live_p99_le_50ms": cc["health_live_ms"]["p99"] <= 50,
        "normal_p50_at_most_doubles": cc["normal_request_ms"]["ratio"] <= 2.0,
        "slow_clients_others_unaffected": set(sc["bulk_requests_meanwhile"]) == {"200"}
        and sc["normal_request_ms"]["during_p50"] <= 2 * sc["normal_request_ms"]["alone_p50"],
        "slow_clients_freed_within_timeouts": sc["idle_bulk"]["answered_after_s_max"] <= 10 + 2
        and sc["slow_head"]["closed_after_s_max"] <= 10 + 2,
        "d2_all_499": summary["d1_d2"]["d2_counted_499_client_closed"] == 200,
        "sigterm_exit_0_within_timeout_plus_1s": sg["exit_code"] == 0 and sg["exit_after_s"] <= 5 + 1
        and sg["stalled_clients"]["request_never_finishing"]["status"] == 503,
        # in flight at SIGTERM: answered 200; sent after it: refused 503, or not connected once the process is gone
        # (a request sent just before the signal can reach the server after it: 503 is its answer)
        "sigterm_every_request_answered": set(sg["requests_sent_before_sigterm"]) <= {"200", "503"}
        and set(sg["requests_sent_after_sigterm"]) <= {"503", "ConnectError", "ReadError", "RemoteProtocolError"},
        "no_responses_ge_500": summary["main_server"]["responses_ge_500"] == 0,
        "no_tracebacks": summary["main_server"]["log_tracebacks"] == 0 and sg["log_tracebacks"] == 0,
    }
    summary["targets"] = targets
    summary["pass"] = all(targets.values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({"targets": targets, "pass": summary["pass"]}), flush=True)
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

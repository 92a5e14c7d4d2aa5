"""Issue 6.9 on the GPU: the vLLM engine core killed mid-load and after ready.

For each case a real ``clef-systemone --backend vllm`` serves a tiny checkpoint built on the spot:

* ``mid-load``: SIGKILL the engine-core process as soon as it exists, before ``/health`` is 200.
  Expected: ``/health`` never 200, the server exits non-zero (no hang).
* ``after-ready``: serve one request, SIGKILL the engine core, keep asking. Expected: ``/health``
  turns 503, a request gets 503 (never a hang or a 200 with garbage), the server exits non-zero.

    python3 tests/gpu/engine_kill.py --out $OUT      (after ``source tests/gpu/env.sh``)

Writes ``engine_kill.json`` (+ the server logs) and exits non-zero if a case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

from clef_vllm.testing.server import LiveServer

REQUEST = {"model": "clef-flash", "state": {"ticket": "refund please", "amount": 12.5},
           "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"},
                         "team": {"type": "choice", "instructions": "Which team?",
                                  "criteria": {"billing": "Payments", "tech": "Errors", "sales": "Plans"}}}}


def is_engine_core(p: psutil.Process) -> bool:
    """A vLLM engine-core process (setproctitle ``VLLM::EngineCore``); False if it is gone."""
    try:
        return "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def engine_cores(server_pid: int) -> list[psutil.Process]:
    """Descendants of the server that are vLLM engine cores."""
    try:
        kids = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in kids if is_engine_core(p)]


def start_server(ckpt: Path, port: int, log: Path) -> LiveServer:
    """The vLLM server in its own process group (a SIGKILLed server's engine cores go with it)."""
    return LiveServer(["--model", str(ckpt), "--backend", "vllm", "--host", "127.0.0.1", "--gdn-prefill-backend",
                       "triton", "--gpu-memory-utilization", "0.3", "--max-model-len", "8192"], port=port, log_path=log,
                      new_session=True)


def wait_exit(server: LiveServer, limit: float, trace: list) -> int | None:
    """Poll /health until the server exits (its return code) or ``limit`` seconds pass (None).

    Unlike :meth:`LiveServer.wait_ready` this watches for the exit, recording every health status."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        rc = server.proc.poll()
        if rc is not None:
            return rc
        status, _ = server.call("/health", timeout=2)
        trace.append((round(time.monotonic() - t0, 1), status))
        time.sleep(0.5)
    return None


def reap(server: LiveServer) -> None:
    server.kill()
    server.stop()
    for p in psutil.process_iter():  # engine cores orphaned by a SIGKILLed server
        if is_engine_core(p):
            try:
                p.kill()
            except psutil.Error:
                pass


def case_mid_load(ckpt: Path, port: int, out: Path) -> dict:
    server = start_server(ckpt, port, out / "server-mid-load.log")
    proc = server.proc
    t0 = time.monotonic()
    killed, health_200 = None, False
    try:
        while time.monotonic() - t0 < 300 and proc.poll() is None:
            cores = engine_cores(proc.pid)
            if cores:
                time.sleep(3)  # inside the engine's start (weights, profiling, compile)
                if server.call("/health", timeout=2)[0] == 200:
                    health_200 = True
                for p in engine_cores(proc.pid):
                    p.kill()
                killed = round(time.monotonic() - t0, 1)
                break
            time.sleep(0.2)
        trace: list = []
        rc = wait_exit(server, 180, trace) if killed is not None else None
        health_200 = health_200 or any(s == 200 for _, s in trace)
        result = {"killed_after_s": killed, "server_rc": rc, "exit_after_kill_s":
                  (round(time.monotonic() - t0 - killed, 1) if killed is not None and rc is not None else None),
                  "health_200_seen": health_200, "health_trace_tail": trace[-5:]}
        result["ok"] = killed is not None and rc not in (None, 0) and not health_200
        return result
    finally:
        reap(server)


def case_after_ready(ckpt: Path, port: int, out: Path) -> dict:
    server = start_server(ckpt, port, out / "server-after-ready.log")
    t0 = time.monotonic()
    try:
        try:
            server.wait_ready(timeout=400, poll_s=1.0)
            ready = True
        except (RuntimeError, TimeoutError):
            ready = False
        result: dict = {"ready_after_s": round(time.monotonic() - t0, 1), "ready": ready}
        if not ready:
            result["ok"] = False
            return result
        result["before_kill"] = server.call("/v1/systemone", REQUEST)[0]
        cores = engine_cores(server.pid)
        result["engine_cores_killed"] = len(cores)
        for p in cores:
            p.kill()
        t_kill = time.monotonic()
        result["after_kill"] = server.call("/v1/systemone", REQUEST, timeout=60)
        result["after_kill"] = [result["after_kill"][0], result["after_kill"][1][:300]]
        trace: list = []
        rc = wait_exit(server, 120, trace)
        result.update(server_rc=rc, exit_after_kill_s=round(time.monotonic() - t_kill, 1) if rc is not None else None,
                      health_trace=trace[:3] + trace[-3:])
        result["ok"] = (result["before_kill"] == 200 and len(cores) > 0 and result["after_kill"][0] == 503
                        and rc not in (None, 0))
        return result
    finally:
        reap(server)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--port", type=int, default=8791)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from clef_vllm.model.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", layout="release")
    results = {}
    for name, case in (("after_ready", case_after_ready), ("mid_load", case_mid_load)):
        t = time.monotonic()
        try:
            results[name] = case(ckpt, args.port, out)
        except Exception as exc:  # noqa: BLE001 - recorded, the other case still runs
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results[name]["case_wall_s"] = round(time.monotonic() - t, 1)
        print(name, json.dumps(results[name]), flush=True)
    results["ok"] = all(r.get("ok") for r in results.values() if isinstance(r, dict))
    (out / "engine_kill.json").write_text(json.dumps(results, indent=2))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

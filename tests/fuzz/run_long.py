"""Long fuzz run: at least 10,000 generated requests against a real clef-systemone; writes a summary.

    python tests/fuzz/run_long.py --out bench/results/fuzz_long.json            # starts a CPU server
                                                                               # (--max-model-len 2048)
    python tests/fuzz/run_long.py --url http://127.0.0.1:8000 --out fuzz.json  # an existing server

Phases (each a hypothesis run with a random seed, recorded in the summary):

1. schemathesis, positive data for ``POST /v1/systemone`` from the server's OpenAPI document;
2. schemathesis, negative data (schema-violating bodies and headers);
3. hostile raw bodies (tests/fuzz/strategies.py ``raw_bodies``): any Unicode incl. lone surrogates
   and invalid UTF-8, special tokens, huge numbers, nesting past the decoder's limit, truncated and
   corrupted bytes, unknown fields, media;
4. valid requests with hostile content (special tokens, any non-surrogate Unicode, huge numbers, long
   states): each must be answered (200), or refused with 413 when its schema alone is over the limit;
5. raw bodies as NDJSON lines of ``POST /v1/systemone/bulk`` streams (each line counts as a request);
6. in-process: the request model and the encoder (Qwen3.5 tokenizer) on generated requests.

Pass: 0 responses >= 500, 0 malformed responses, 0 transport errors, the server alive at the end with
no traceback or "internal error" in its log, 0 in-process exceptions other than RequestError.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
# run as a script: this folder is sys.path[0], so the strategies module imports as a top-level one
from strategies import check_encoding, check_response, check_valid_response, raw_bodies, requests, valid_requests

from clef_vllm.testing.server import LiveServer


class Tally:
    def __init__(self):
        self.phases: dict[str, dict] = {}
        self.failures: list[dict] = []

    def phase(self, name: str) -> dict:
        return self.phases.setdefault(name, {"requests": 0, "statuses": Counter(), "failures": 0, "seconds": 0.0})

    def record(self, name: str, status: int | str, problem: str | None, sent: bytes | None = None) -> None:
        p = self.phase(name)
        p["requests"] += 1
        p["statuses"][str(status)] += 1
        if problem:
            p["failures"] += 1
            if len(self.failures) < 50:
                self.failures.append({"phase": name, "status": status, "problem": problem[:500],
                                      "sent": None if sent is None else sent[:500].decode("utf-8", "replace")})


def run_hypothesis(fn, strategy, examples: int, seed: int):
    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def inner(value):
        fn(value)

    inner()


def start_server(args) -> LiveServer:
    """A CPU reference server on a tiny checkpoint built on the spot."""
    from clef_vllm.model.tiny import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="clef-fuzz-"))
    ckpt = build_tiny_checkpoint(work / "tiny", mtp=True)
    server = LiveServer(["--model", str(ckpt), "--backend", "reference", *args.server_arg], ready_timeout=300,
                        log_path=work / "server.log")
    try:
        return server.wait_ready(poll_s=0.5)
    except (RuntimeError, TimeoutError) as exc:
        raise SystemExit(f"server did not start: {exc}") from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="fuzz this server (default: start a CPU reference server on the tiny checkpoint)")
    p.add_argument("--server-arg", action="append", default=None,
                   help="clef-systemone flag for the started server (default: --max-model-len 2048, so the "
                        "fuzzed requests also hit truncation and the schema limit)")
    p.add_argument("--positive", type=int, default=2500, help="schemathesis positive examples")
    p.add_argument("--negative", type=int, default=2500, help="schemathesis negative examples")
    p.add_argument("--raw", type=int, default=4500, help="hostile raw bodies")
    p.add_argument("--valid", type=int, default=3000, help="valid requests with hostile content")
    p.add_argument("--bulk", type=int, default=300, help="bulk streams (1-8 lines each)")
    p.add_argument("--inprocess", type=int, default=3000, help="in-process model + encoder examples")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.server_arg is None:
        args.server_arg = ["--max-model-len", "2048"]
    seed = args.seed if args.seed is not None else random.randrange(2 ** 32)
    os.environ.setdefault("CLEF_VLLM_CACHE", str(Path(tempfile.gettempdir()) / "clef-vllm-cache"))

    server = None
    url = args.url
    if url is None:
        server = start_server(args)
        url = server.url
    tally = Tally()
    client = httpx.Client(base_url=url, timeout=120)
    started = time.time()

    def timed(name, fn):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a hypothesis failure is recorded, the run goes on
            tally.failures.append({"phase": name, "problem": f"{type(exc).__name__}: {str(exc)[:1500]}"})
        tally.phase(name)["seconds"] += time.perf_counter() - t0
        print(f"{name}: {tally.phase(name)['requests']} requests, {dict(tally.phase(name)['statuses'])}", flush=True)

    # 1-2. schemathesis
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                     status_code_conformance)

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operation = schema["/v1/systemone"]["POST"]
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

    def schemathesis_phase(name, mode, n):
        def one(case):
            try:
                response = case.call(base_url=url, timeout=120)
            except Exception as exc:  # noqa: BLE001
                tally.record(name, "transport-error", f"{type(exc).__name__}: {exc}")
                return
            problem = None
            try:
                case.validate_response(response, checks=checks)
            except Exception as exc:  # noqa: BLE001 - schemathesis raises a failure group
                problem = f"{type(exc).__name__}: {str(exc)[:400]}"
            tally.record(name, response.status_code, problem, json.dumps(case.body, default=str).encode()[:500]
                         if case.body is not None else None)

        run_hypothesis(one, operation.as_strategy(generation_mode=mode), n, seed)

    timed("schemathesis-positive", lambda: schemathesis_phase("schemathesis-positive", GenerationMode.POSITIVE,
                                                              args.positive))
    timed("schemathesis-negative", lambda: schemathesis_phase("schemathesis-negative", GenerationMode.NEGATIVE,
                                                              args.negative))

    # 3. raw bodies
    def raw_one(body: bytes):
        try:
            resp = client.post("/v1/systemone", content=body, headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            tally.record("raw-bodies", "transport-error", f"{type(exc).__name__}: {exc}", body)
            return
        tally.record("raw-bodies", resp.status_code, check_response(resp.status_code, resp.headers, resp.content, body),
                     body)

    timed("raw-bodies", lambda: run_hypothesis(raw_one, raw_bodies, args.raw, seed + 1))

    # 3b. valid requests with hostile content: answered (200) or 413 for a schema over the limit
    def valid_one(body: dict):
        sent = json.dumps(body).encode()
        try:
            resp = client.post("/v1/systemone", content=sent, headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            tally.record("valid-hostile", "transport-error", f"{type(exc).__name__}: {exc}", sent)
            return
        problem = check_response(resp.status_code, resp.headers, resp.content, sent)
        tally.record("valid-hostile", resp.status_code, problem or check_valid_response(resp.status_code, resp.content,
                                                                                         body), sent)

    timed("valid-hostile", lambda: run_hypothesis(valid_one, valid_requests, args.valid, seed + 4))

    # 4. bulk streams
    line = raw_bodies.filter(lambda b: b"\n" not in b and b"\r" not in b)

    def bulk_one(lines: list[bytes]):
        try:
            resp = client.post("/v1/systemone/bulk", content=b"\n".join(lines) + b"\n",
                               headers={"Content-Type": "application/x-ndjson"})
        except httpx.HTTPError as exc:
            tally.record("bulk-lines", "transport-error", f"{type(exc).__name__}: {exc}")
            return
        tally.phase("bulk-streams")["requests"] += 1
        tally.phase("bulk-streams")["statuses"][str(resp.status_code)] += 1
        if resp.status_code != 200:
            tally.record("bulk-lines", resp.status_code, f"bulk stream answered {resp.status_code}")
            return
        out = [json.loads(x) for x in resp.content.split(b"\n") if x]
        expected = [i for i, x in enumerate(lines) if x.strip()]
        if sorted(o.get("index", -1) for o in out[:-1]) != expected or out[-1].get("summary", {}).get("aborted"):
            tally.record("bulk-lines", "bad-stream", f"indices or summary wrong: {out[-1]}")
            return
        for o in out[:-1]:
            tally.record("bulk-lines", o["status"], check_response(
                o["status"], {"x-request-id": "-", "server-timing": "-"}, json.dumps(o["body"]).encode(),
                lines[o["index"]]), lines[o["index"]])

    timed("bulk-lines", lambda: run_hypothesis(bulk_one, st.lists(line, min_size=1, max_size=8), args.bulk, seed + 2))

    # 5. in-process model + encoder
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.testing.qwen_tokenizer import cached_qwen35_tokenizer

    encoder = RequestEncoder.from_pretrained(cached_qwen35_tokenizer(Path(os.environ["CLEF_VLLM_CACHE"])),
                                             max_length=4096)

    def inprocess_one(body):
        try:
            check_encoding(encoder, body)
            tally.record("inprocess-model-encoder", "ok", None)
        except Exception as exc:  # noqa: BLE001
            tally.record("inprocess-model-encoder", "exception", f"{type(exc).__name__}: {exc}",
                         json.dumps(body, default=str).encode("utf-8", "surrogatepass"))

    timed("inprocess-model-encoder", lambda: run_hypothesis(inprocess_one, requests, args.inprocess, seed + 3))

    # the server afterwards
    alive = True
    try:
        alive = client.get("/health").status_code == 200
    except httpx.HTTPError:
        alive = False
    metrics = client.get("/metrics").text if alive else ""
    log_text = server.log() if server else ""
    exit_code = None
    if server is not None:
        exit_code = server.stop(timeout=120)     # SIGTERM: a graceful drain must exit 0
        log_text = server.log()
    http_phases = [k for k in tally.phases if k not in ("inprocess-model-encoder", "bulk-streams")]
    http_requests = sum(tally.phases[k]["requests"] for k in http_phases)
    ge500 = sum(n for k in http_phases for s, n in tally.phases[k]["statuses"].items() if s.isdigit() and int(s) >= 500)
    transport = sum(tally.phases[k]["statuses"].get("transport-error", 0) for k in http_phases)
    summary = {
        "command": " ".join(["python", "tests/fuzz/run_long.py", *sys.argv[1:]]),
        "seed": seed,
        "server": (f"started: clef-systemone --backend reference {' '.join(args.server_arg)} on the tiny checkpoint "
                   "(CPU)") if server else url,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "http_requests": http_requests,
        "responses_ge_500": ge500,
        "transport_errors": transport,
        "malformed_or_failed_checks": sum(tally.phases[k]["failures"] for k in http_phases),
        "inprocess_examples": tally.phase("inprocess-model-encoder")["requests"],
        "inprocess_exceptions": tally.phase("inprocess-model-encoder")["failures"],
        "server_alive_at_end": alive,
        "server_exit_code_after_sigterm": exit_code,
        "server_log_tracebacks": log_text.count("Traceback"),
        "server_log_internal_errors": log_text.count("internal error"),
        "server_requests_by_status": {line.split('status="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                                      for line in metrics.splitlines()
                                      if line.startswith("clef_requests_total") and 'route="/v1/systemone"' in line}
        if metrics else {},
        "phases": {k: {**v, "statuses": dict(v["statuses"]), "seconds": round(v["seconds"], 1)}
                   for k, v in tally.phases.items()},
        "failures": tally.failures,
    }
    summary["pass"] = (http_requests >= 10_000 and ge500 == 0 and transport == 0 and alive
                       and summary["malformed_or_failed_checks"] == 0 and summary["inprocess_exceptions"] == 0
                       and summary["server_log_tracebacks"] == 0 and summary["server_log_internal_errors"] == 0
                       and not tally.failures and exit_code in (None, 0))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: summary[k] for k in ("http_requests", "responses_ge_500", "transport_errors",
                                               "malformed_or_failed_checks", "inprocess_examples",
                                               "inprocess_exceptions", "server_alive_at_end", "pass")}), flush=True)
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Soak: hold a clef-systemone server at saturation for a while; check every response against its
own request; track the server's memory (RSS of its process tree, GPU memory when nvidia-smi is
there); write a summary JSON. Exit status 1 if any response was lost or did not match.

Each request carries a unique marker in ``model`` and in every question id, so a response that
belongs to another request (or is missing a question, reorders them, or swaps option keys) is
caught. With ``--tokenizer`` the client encodes every request itself and checks
``usage.input_tokens`` exactly. A small share of requests is invalid on purpose (their 422 is
checked) and a small share goes through ``POST /v1/systemone/bulk`` (each line checked).
Refusals (429) are counted and retried, never counted as lost.

``--mix adversarial`` adds the hostile clients of :class:`Attacks` (its table names each attack and the
answer it must get: slowloris heads, slow and huge bodies, deep nesting, many-valued bodies, a
million-line bulk body, UTF-16/UTF-32/BOM/invalid UTF-8, NaN, repeated keys, compressed bodies, invalid
HTTP, pipelining with request ids, half-close, disconnects mid-body, a connection flood with probes),
run by ``--attackers`` tasks beside the load; with ``--launch`` the server gets ``MIX_SERVER_FLAGS`` (every
limit set, short timeouts) unless given after ``--``. Every second the RSS and the server's loop-lag
histogram are sampled, and ``/health/live`` is timed twice a second; ``--warmup``/``--quiet`` give the
warm RSS (load, then a pause), ``--idle`` the RSS after the load. With JSON server logs each request id is
checked against the access lines. ``--mix media`` runs :attr:`Attacks.media` instead: decompression bombs,
truncated PNG/JPEG/WebP, a wrong MIME type, bad base64, URLs, images past the token limit, pads typed
in text, valid 1x1 and photo-sized images (what a server's RSS does over many of them). The summary's first
fields are the issue's: minutes, requests,
responses_5xx, lost, rss_warm_mb, rss_peak_mb, rss_end_mb, rss_idle_mb, loop_lag_p99_ms, health_p99_ms,
command, then ``targets`` and ``pass``.

    # the adversarial mix: short (CI: tests/adversarial/test_mix.py) and full (bench/results/soak_cpu.json)
    python bench/soak.py --launch --mix adversarial --duration 20 --concurrency 4 --out mix.json -- --model demo
    python bench/soak.py --launch --mix adversarial --warmup 120 --duration 1800 --idle 300 --concurrency 16 \
        --out soak_cpu.json -- --model demo --backend reference
    # hostile and valid images (bench/results/soak_media_cpu.json)
    python bench/soak.py --launch --mix media --warmup 30 --duration 300 --idle 60 --concurrency 2 --attackers 4 \
        --out soak_media_cpu.json -- --model demo --backend reference
    # against a running server (its pid for RSS)
    python bench/soak.py --url http://127.0.0.1:8000 --pid 1234 --duration 1800 --out soak.json
    # or start one (GPU: --backend vllm; CPU: --backend reference) and stop it with SIGTERM at the end
    python bench/soak.py --launch --duration 600 --out soak.json -- --model CKPT --backend vllm
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from clef_vllm.bench.loadgen import distribution_ms
from clef_vllm.testing.bodies import nested_level, state_array
from clef_vllm.testing.images import data_uri, image_bytes, noisy, png_declaring
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
        from clef_vllm.schema.dialects import parse_request

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


# --------------------------------------------------------------------------- adversarial mix

#: The server flags the adversarial mix is written for (``--mix adversarial --launch`` adds them unless given):
#: every limit set, short timeouts so a slow client is cut within seconds.
MIX_SERVER_FLAGS = {"--header-timeout": "2", "--body-timeout": "2", "--min-body-rate": "4096",
                    "--max-body-bytes": str(2 * 2 ** 20), "--max-connections": "256", "--max-bulk-lines": "100000",
                    "--max-bulk-streams": "4", "--keep-alive-timeout": "5", "--log-format": "json"}


async def read_http_response(reader: asyncio.StreamReader, timeout: float) -> tuple[int | None, dict, bytes]:
    """``(status, headers, body)`` of the next final response (1xx skipped); status ``None`` when the
    connection closed (or nothing came within ``timeout``) first."""
    async def read() -> tuple[int | None, dict, bytes]:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return None, {}, b""
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
            if status >= 200:
                break
        try:
            if "content-length" in headers:
                return status, headers, await reader.readexactly(int(headers["content-length"]))
            body = b""
            while True:                                   # chunked
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    return status, headers, body
                body += chunk[:-2]
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return status, headers, b""

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        return None, {}, b"timeout"


def http_head(path: str, *, length: int | None, content_type: str = "application/json", extra: dict | None = None,
              method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}",
             *(f"{k}: {v}" for k, v in (extra or {}).items())]
    if method == "POST":
        lines.append("Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Attacks:
    """The hostile clients of the adversarial mix, each with the answer it must get. Every attack opens
    its own connection(s) to the server on loopback, does what no well-behaved client does, and
    returns ``(outcome, detail)``: ``"ok"`` when the server answered as documented, else what it did."""

    def __init__(self, host: str, port: int, headers: dict, max_connections: int, header_timeout: float,
                 body_timeout: float, max_body_bytes: int, max_bulk_lines: int):
        self.host, self.port = host, port
        self.auth = {k: v for k, v in headers.items()}
        self.max_connections = max_connections
        self.header_timeout, self.body_timeout = header_timeout, body_timeout
        self.max_body_bytes, self.max_bulk_lines = max_body_bytes, max_bulk_lines
        self.others = 0                 # connections the rest of the soak may hold (set by the runner)
        #: how long an attack whose request reaches the engine waits for its answer (the load's --client-timeout)
        self.answer_timeout = 600.0
        self.request = json.dumps({"model": "clef-flash", "state": "Checkout is down.",
                                   "questions": {"urgent": {"type": "noul", "instructions": "Urgent?"}}}).encode()
        #: name -> (coroutine function, what it must get); the runner picks among them
        self.table = {
            "slowloris_head": (self.slowloris_head, "408 within --header-timeout"),
            "idle_connection": (self.idle_connection, "closed within --header-timeout"),
            "slow_body": (self.slow_body, "408 within --body-timeout"),
            "declared_huge_body": (self.declared_huge_body, "413 before the body is read"),
            "streamed_huge_body": (self.streamed_huge_body, "413 once past --max-body-bytes"),
            "deep_nesting": (self.deep_nesting, "400 or 413 naming the nesting"),
            "many_values": (self.many_values, "413 (JSON values)"),
            "million_line_bulk": (self.million_line_bulk, "200 stream: line --max-bulk-lines answered 413, aborted"),
            "utf16_body": (self.encoding("utf-16"), "400 naming UTF-16"),
            "utf32_body": (self.encoding("utf-32"), "400 naming UTF-32"),
            "bom_body": (self.encoding("utf-8-sig"), "400 naming the byte order mark"),
            "invalid_utf8": (self.invalid_utf8, "400 (not valid UTF-8)"),
            "nan_number": (self.nan_number, "400 (NaN is not JSON)"),
            "duplicate_keys": (self.duplicate_keys, "422 naming the key"),
            "compressed_body": (self.compressed_body, "415 (Content-Encoding)"),
            "invalid_http": (self.invalid_http, "400 (JSON)"),
            "pipelined": (self.pipelined, "3 x 200 in order, each with its own X-Request-Id"),
            "half_close": (self.half_close, "200 after SHUT_WR"),
            "disconnect_mid_body": (self.disconnect_mid_body, "nothing (the server counts 499)"),
            "connection_flood": (self.connection_flood, "/health/live 200 and anything else 503 while the connections are full"),
        }
        #: ``--mix media``: hostile and valid images instead (the server's RSS over many of them is the point)
        self.media = {
            "image_bomb": (self.image([data_uri(png_declaring(100_000, 100_000))]), "413 from the header (10^10 px)"),
            "image_truncated": (self.image([data_uri(noisy("PNG")[:900])], 422, "truncated or corrupt"), "422"),
            "image_truncated_jpeg": (self.image([data_uri(noisy("JPEG")[:700], "image/jpeg")], 422), "422"),
            "image_truncated_webp": (self.image([data_uri(noisy("WEBP")[:500], "image/webp")], 422), "422"),
            "image_wrong_mime": (self.image([data_uri(noisy("JPEG"))], 422, "declares PNG"), "422 naming both formats"),
            "image_bad_base64": (self.image(["data:image/png;base64,@@@@"], 400, "not valid base64"), "400"),
            "image_url": (self.image(["https://example.com/a.png"], 400, "not fetched"), "400 (URLs are not fetched)"),
            "image_past_the_token_limit": (self.image([data_uri(image_bytes("PNG", (4000, 4000), color="white"))] * 2, 413,
                                                      "media ("), "413 naming the media's tokens"),
            "image_pads_typed_in_text": (self.image([], 200, state="<|vision_start|><|image_pad|><|vision_end|>"),
                                         "200: the pads are text"),
            "image_1x1": (self.image([data_uri(noisy("PNG", (1, 1)))], 200), "200"),
            "image_photo": (self.image([data_uri(noisy("JPEG", (512, 384)), "image/jpeg")], 200), "200 (192 tokens)"),
        }

    async def _open(self):
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=2 ** 22)
        return reader, writer

    async def _exchange(self, data: bytes, timeout: float = 60.0) -> tuple[int | None, dict, bytes]:
        reader, writer = await self._open()
        try:
            writer.write(data)
            await writer.drain()
            return await read_http_response(reader, timeout)
        except ConnectionError:
            return await read_http_response(reader, 5)
        finally:
            writer.close()

    def _post(self, body: bytes, path: str = "/v1/systemone", content_type: str = "application/json",
              extra: dict | None = None) -> bytes:
        return http_head(path, length=len(body), content_type=content_type, extra={**self.auth, **(extra or {})}) + body

    @staticmethod
    def _expect(status, body: bytes, want: tuple[int, ...], *fragments: str) -> tuple[str, str]:
        text = body.decode("utf-8", "replace")
        if status in want and all(f in text for f in fragments):
            return "ok", str(status)
        return ("lost" if status is None else "unexpected"), f"{status}: {text[:160]}"

    async def slowloris_head(self):
        reader, writer = await self._open()
        t0 = time.monotonic()
        try:
            writer.write(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
            status, _, body = await read_http_response(reader, self.header_timeout + 10)
        finally:
            writer.close()
        late = time.monotonic() - t0 > self.header_timeout + 5
        return ("unexpected", f"{status} after {time.monotonic() - t0:.1f} s") if late else \
            self._expect(status, body, (408,), "--header-timeout")

    async def idle_connection(self):
        reader, writer = await self._open()
        t0 = time.monotonic()
        try:
            status, _, body = await read_http_response(reader, self.header_timeout + 10)
        finally:
            writer.close()
        closed = status is None and body != b"timeout"
        return ("ok", "closed") if closed else ("unexpected", f"{status} {body[:80]!r} after {time.monotonic() - t0:.1f} s")

    async def slow_body(self):
        reader, writer = await self._open()
        try:
            writer.write(http_head("/v1/systemone", length=1000, extra=self.auth) + b'{"model":')
            await writer.drain()
            status, _, body = await read_http_response(reader, self.body_timeout + 10)
        finally:
            writer.close()
        return self._expect(status, body, (408,), "too slow")

    async def declared_huge_body(self):
        data = http_head("/v1/systemone", length=self.max_body_bytes + 1, extra=self.auth) + b'{"model":"m"'
        status, _, body = await self._exchange(data)
        return self._expect(status, body, (413,), "--max-body-bytes")

    async def streamed_huge_body(self):
        reader, writer = await self._open()
        piece = chunk(b'{"state":"' + b"x" * (2 ** 16))
        sent = 0
        try:
            writer.write(http_head("/v1/systemone", length=None, extra=self.auth))
            while sent <= self.max_body_bytes + 2 ** 17:
                writer.write(piece)
                await writer.drain()
                sent += len(piece)
        except ConnectionError:
            pass
        try:
            status, _, body = await read_http_response(reader, 60)
        finally:
            writer.close()
        return self._expect(status, body, (413,), "--max-body-bytes")

    async def deep_nesting(self):
        status, _, body = await self._exchange(self._post(nested_level(5000)))
        return self._expect(status, body, (400, 413), "nested")

    async def many_values(self):
        status, _, body = await self._exchange(self._post(state_array(min(self.max_body_bytes, 2 ** 20))))
        return self._expect(status, body, (413,), "JSON values")

    async def million_line_bulk(self):
        lines = b"\n" * 1_000_000 + self.request + b"\n"
        status, _, body = await self._exchange(self._post(lines, "/v1/systemone/bulk", "application/x-ndjson"), 120)
        if status != 200:
            return self._expect(status, body, (200,))
        out = [json.loads(x) for x in body.splitlines() if x.strip()]
        summary = out[-1].get("summary", {}) if out else {}
        cut = [x for x in out[:-1] if x.get("index") == self.max_bulk_lines and x.get("status") == 413]
        if self.max_bulk_lines < 1_000_001 and cut and "--max-bulk-lines" in (summary.get("aborted") or ""):
            return "ok", "413 at the line limit"
        return "unexpected", f"{body[-200:]!r}"

    def encoding(self, codec: str):
        async def attack():
            status, _, body = await self._exchange(self._post(self.request.decode().encode(codec)))
            what = "byte order mark" if codec == "utf-8-sig" else codec.upper()
            return self._expect(status, body, (400,), what)
        return attack

    async def invalid_utf8(self):
        status, _, body = await self._exchange(self._post(self.request.replace(b"Checkout", b"Check\xff\xfeout")))
        return self._expect(status, body, (400,), "UTF-8")

    async def nan_number(self):
        status, _, body = await self._exchange(self._post(self.request.replace(b'"Checkout is down."', b"NaN")))
        return self._expect(status, body, (400,), "NaN")

    async def duplicate_keys(self):
        body = self.request[:-1] + b',"state":"a different state"}'
        status, _, text = await self._exchange(self._post(body))
        return self._expect(status, text, (422,), "duplicate key", "state")

    async def compressed_body(self):
        status, _, body = await self._exchange(self._post(gzip.compress(self.request), extra={"Content-Encoding": "gzip"}))
        return self._expect(status, body, (415,), "Content-Encoding")

    async def invalid_http(self):
        status, _, body = await self._exchange(b"GARBAGE \x01\x02 HTTP/9.9\r\n\r\n")
        return self._expect(status, body, (400,), "invalid HTTP request")

    async def pipelined(self):
        tag = f"pipe{random.randrange(10 ** 9)}"
        data = b"".join(self._post(self.request, extra={"X-Request-Id": f"{tag}-{i}"}) for i in range(3))
        reader, writer = await self._open()
        got = []
        try:
            writer.write(data)
            await writer.drain()
            for _ in range(3):
                status, headers, body = await read_http_response(reader, self.answer_timeout)
                got.append((status, headers.get("x-request-id")))
        finally:
            writer.close()
        want = [(200, f"{tag}-{i}") for i in range(3)]
        if got == want:
            return "ok", "3 x 200"
        return ("lost" if any(s is None for s, _ in got) else "misattributed"), f"{got}"

    async def half_close(self):
        reader, writer = await self._open()
        try:
            writer.write(self._post(self.request))
            await writer.drain()
            writer.write_eof()
            status, _, body = await read_http_response(reader, self.answer_timeout)
        finally:
            writer.close()
        return self._expect(status, body, (200,), '"answers"')

    async def disconnect_mid_body(self):
        reader, writer = await self._open()
        writer.write(http_head("/v1/systemone", length=len(self.request), extra=self.auth) + self.request[:20])
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.transport.abort()
        return "ok", "left"

    def image(self, images: list, status: int = 413, fragment: str = "", state: str = "Checkout is down."):
        """An attack that posts ``images`` (and ``state``) and must get ``status`` with ``fragment`` in the body."""
        body = json.dumps({"model": "clef-flash", "state": state, "images": images,
                           "questions": {"urgent": {"type": "noul", "instructions": "Urgent?"}}}).encode()

        async def attack():
            status_got, _, text = await self._exchange(self._post(body), self.answer_timeout)
            return self._expect(status_got, text, (status,), fragment)
        return attack

    async def connection_flood(self):
        """Fill the connection limit with idle connections (more until a request other than a probe on a
        fresh one gets the documented 503), then probe: ``/health/live`` must answer 200 on one of the connections kept for
        the probes. ``others`` is how many connections the rest of the soak may hold open."""
        opened = []
        post = (None, {}, b"")
        try:
            for _ in range(max(0, self.max_connections - self.others)):
                opened.append(await self._open())
            for _ in range(4 * 16):               # GET /v1/models: answered at once unless the connections are full
                await asyncio.sleep(0.02)
                post = await self._exchange(http_head("/v1/models", length=None, method="GET", extra=self.auth), 30)
                if post[0] != 200:
                    break
                for _ in range(4):
                    opened.append(await self._open())
            live = await self._exchange(http_head("/health/live", length=None, method="GET", extra=self.auth), 10)
        except OSError as exc:
            return "unexpected", f"could not open connections: {exc}"
        finally:
            for _, writer in opened:
                writer.close()
            await asyncio.gather(*(writer.wait_closed() for _, writer in opened), return_exceptions=True)
            await asyncio.sleep(0.5)            # the server has seen them close before the next attack connects
        if live[0] == 200 and post[0] == 503 and b"--max-connections" in post[2]:
            return "ok", "live 200, other 503"
        return ("lost" if live[0] is None else "unexpected"), f"live {live[0]}, other {post[0]} {post[2][:100]!r}"


class AttackRunner:
    """Runs :class:`Attacks` from ``workers`` tasks until the deadline, each picking attacks in turn
    (shuffled); the connection flood runs alone (the others wait), as it takes every connection."""

    EXCLUSIVE = ("connection_flood",)

    def __init__(self, attacks: Attacks, workers: int, seed: int):
        self.attacks = attacks
        self.workers = workers
        self.seed = seed
        self.results: dict[str, dict] = {name: {"runs": 0, "ok": 0, "unexpected": 0, "lost": 0, "misattributed": 0,
                                                "expected": expected, "examples": []}
                                         for name, (_, expected) in attacks.table.items()}
        self.gate = asyncio.Event()
        self.gate.set()
        self.active = 0
        self.pipelined_ids: list[str] = []

    async def _one(self, name: str) -> None:
        fn, _ = self.attacks.table[name]
        exclusive = name in self.EXCLUSIVE
        if exclusive:
            self.gate.clear()
            while self.active:
                await asyncio.sleep(0.01)
        else:
            await self.gate.wait()
        self.active += 1
        try:
            outcome, detail = await fn()
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            outcome, detail = "unexpected", f"{type(exc).__name__}: {exc}"
        finally:
            self.active -= 1
            if exclusive:
                self.gate.set()
        record = self.results[name]
        record["runs"] += 1
        record[outcome] += 1
        if outcome != "ok" and len(record["examples"]) < 5:
            record["examples"].append(detail[:300])

    async def worker(self, deadline: float, index: int) -> None:
        """The first round shares the table among the workers and always runs to its end (each attack runs
        once, however short the run); then every worker goes through all of it (the exclusive ones: worker 0)
        in shuffled rounds until the deadline."""
        rng = random.Random(self.seed * 1000 + index)
        every = list(self.attacks.table)
        names = [n for n in every if n not in self.EXCLUSIVE or index == 0]
        for name in every[index::self.workers]:
            await self._one(name)
        while time.monotonic() < deadline:
            for name in rng.sample(names, len(names)):
                if time.monotonic() >= deadline:
                    return
                await self._one(name)

    async def run(self, deadline: float) -> None:
        await asyncio.gather(*(self.worker(deadline, i) for i in range(self.workers)))

    def summary(self) -> dict:
        return self.results


# --------------------------------------------------------------------------- per-second samples: loop lag, probes


def lag_buckets(text: str, loop: str = "http") -> dict[float, float]:
    """The server's ``clef_event_loop_lag_seconds`` histogram (cumulative count per upper bound)."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("clef_event_loop_lag_seconds_bucket{") and f'loop="{loop}"' in line:
            le = line.split('le="')[1].split('"')[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile (0-1) of what a cumulative histogram gained between two scrapes, interpolated
    linearly inside its bucket (as Prometheus' ``histogram_quantile``); the last finite bound when it
    falls in the +Inf bucket."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for bound, cum in zip(bounds, counts):
        if cum >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((rank - below) / (cum - below) if cum > below else 1.0)
        lower, below = bound, cum
    return lower


def _probe_process(url: str, headers: dict, every: float, t0: float, done, results) -> None:
    """In its own process: ``(t, seconds or None)`` of ``GET /health/live`` every ``every`` seconds on one
    kept-alive connection until ``done`` is set, then the list into ``results``."""
    out: list[tuple[float, float | None]] = []
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        while not done.is_set():
            start = time.perf_counter()
            try:
                ok = client.get("/health/live").status_code == 200
            except httpx.HTTPError:
                ok = False
            out.append((time.monotonic() - t0, time.perf_counter() - start if ok else None))
            done.wait(every)
    results.put(out)


class Watcher:
    """Every ``every`` seconds: the server's RSS (``sampler``) and loop-lag histogram; every ``probe_every``
    seconds, ``GET /health/live`` timed on its own connection, from its own process."""

    def __init__(self, url: str, headers: dict, sampler: MemorySampler, every: float = 1.0, probe_every: float = 0.5):
        self.url, self.headers, self.sampler = url, headers, sampler
        self.every, self.probe_every = every, probe_every
        self.lag: list[tuple[float, dict[float, float]]] = []     # (t, cumulative buckets)
        self.load: list[tuple[float, float]] = []                  # (t, the machine's 1-minute load average)
        self.probes: list[tuple[float, float | None]] = []        # (t, seconds; None: no 200)

    async def sample(self, t0: float, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=30) as client:
            while not stop.is_set():
                t = time.monotonic() - t0
                self.sampler.sample(t)
                self.load.append((t, os.getloadavg()[0]))
                try:
                    self.lag.append((t, lag_buckets((await client.get("/metrics")).text)))
                except httpx.HTTPError:
                    pass
                try:
                    await asyncio.wait_for(stop.wait(), self.every)
                except asyncio.TimeoutError:
                    pass

    async def probe(self, t0: float, stop: asyncio.Event) -> None:
        """``GET /health/live`` every ``probe_every`` seconds from a process of its own (a probe timed in this
        process would also time this process's own loop, busy with the load), until ``stop``."""
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        done, results = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_probe_process, args=(self.url, self.headers, self.probe_every, t0, done, results),
                           daemon=True)
        proc.start()
        await stop.wait()
        done.set()
        self.probes = await asyncio.get_running_loop().run_in_executor(None, results.get)
        proc.join(30)

    def lag_p99_ms(self, start: float, end: float) -> float | None:
        inside = [(t, b) for t, b in self.lag if start <= t <= end]
        if len(inside) < 2:
            return None
        q = histogram_quantile(inside[0][1], inside[-1][1], 0.99)
        return None if q is None else round(q * 1000, 1)

    def lag_p99_per_minute_ms(self) -> list[float | None]:
        if not self.lag:
            return []
        out, minute = [], 0
        while minute * 60 <= self.lag[-1][0]:
            out.append(self.lag_p99_ms(minute * 60, (minute + 1) * 60))
            minute += 1
        return out

    def health_ms(self) -> dict:
        times = [x for _, x in self.probes if x is not None]
        return {"probes": len(self.probes), "failed": sum(1 for _, x in self.probes if x is None),
                **(distribution_ms(times) or {})}

    def rss_between(self, start: float, end: float, how=statistics.median) -> float | None:
        values = [rss for t, rss, _ in self.sampler.series if start <= t <= end and rss is not None]
        return round(how(values), 1) if values else None


# --------------------------------------------------------------------------- driver


class Soak:
    def __init__(self, args, encoder=None):
        self.args = args
        self.encoder = encoder
        self.run_id = f"{int(time.time()) % 100000:05d}"
        self.seq = 0
        self.counts = {"sent": 0, "ok": 0, "expected_errors": 0, "mismatched": 0, "lost": 0, "refused_429": 0,
                       "refused_503_connections": 0}
        self.attempts: dict[str, int] = {}          # X-Request-Id -> requests sent with it (429 retries included)
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
            self.attempts[rid] = self.attempts.get(rid, 0) + 1
            if resp.status_code == 429:
                self.counts["refused_429"] += 1
                await asyncio.sleep(min(float(resp.headers.get("retry-after", "1")), 2.0) * rng.random())
                continue
            if resp.status_code == 503 and "--max-connections" in resp.text:   # a connection flood is on (mix)
                self.counts["refused_503_connections"] += 1
                await asyncio.sleep(0.2 * rng.random())
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
        if resp.status_code == 429 or (resp.status_code == 503 and "--max-connections" in resp.text):
            self.bulk["records"] -= len(items)
            self.bulk["streams"] -= 1
            self.counts["refused_429" if resp.status_code == 429 else "refused_503_connections"] += 1
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

    async def run(self, watcher: Watcher, attacks: AttackRunner | None = None) -> dict:
        """``--warmup`` seconds of load (and attacks), ``--quiet`` seconds without (the warm RSS), then
        ``--duration`` seconds of load, then ``--idle`` seconds without; the watcher samples throughout.
        Returns the phases' ends (seconds from the start)."""
        args = self.args
        limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency)
        async with httpx.AsyncClient(base_url=args.url, timeout=args.client_timeout, limits=limits) as client:
            t0 = time.monotonic()
            stop = asyncio.Event()
            watching = [asyncio.create_task(watcher.sample(t0, stop)), asyncio.create_task(watcher.probe(t0, stop))]

            async def load(seconds: float) -> None:
                deadline = time.monotonic() + seconds
                tasks = [self.worker(client, deadline, args.seed + i) for i in range(args.concurrency)]
                if attacks is not None:
                    tasks.append(attacks.run(deadline))
                await asyncio.gather(*tasks)

            phases = {}
            if args.warmup:
                await load(args.warmup)
                phases["warmup_end_s"] = time.monotonic() - t0
                await asyncio.sleep(args.quiet)
                phases["warm_s"] = time.monotonic() - t0
            phases["load_start_s"] = time.monotonic() - t0
            await load(args.duration)
            phases["load_end_s"] = time.monotonic() - t0
            if args.idle:
                print(f"soak: load done after {phases['load_end_s']:.0f} s; idle for {args.idle:g} s", flush=True)
                await asyncio.sleep(args.idle)
            phases["end_s"] = time.monotonic() - t0
            stop.set()
            await asyncio.gather(*watching)
            return phases


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


def server_errors(url: str, headers: dict) -> dict[str, float]:
    """Responses >= 500 the server counted, by route, status and reason (``/metrics``), except the
    documented 503 of a connection past ``--max-connections`` (reason ``connections``)."""
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("clef_requests_total{", "clef_bulk_records_total{")) and 'status="5' in line \
                and 'reason="connections"' not in line:
            out[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def check_log(text: str, attempts: dict[str, int]) -> dict:
    """Request ids in the server's JSON log: each request the soak sent with an id has exactly one
    access line per attempt, each pipelined request (``pipe*``) one, and no line that belongs to no
    request (uvicorn's own) carries a request's id."""
    access: dict[str, int] = {}
    stray: list[str] = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        rid = rec.get("request_id")
        if rec.get("logger") == "clef_vllm.access" and rid:
            access[rid] = access.get(rid, 0) + 1
        elif rid and rec.get("logger", "").startswith("uvicorn"):
            stray.append(f"{rid}: {rec.get('message', '')[:80]}")
    wrong = [rid for rid, n in attempts.items() if access.get(rid, 0) != n]
    wrong += [rid for rid, n in access.items() if rid.startswith("pipe") and n != 1]
    return {"access_lines": sum(access.values()), "ids_checked": len(attempts), "misattributed": len(wrong) + len(stray),
            "examples": (wrong[:5] + stray[:5])}


def flag_value(args: list[str], flag: str, default: str) -> str:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def main(argv: list[str] | None = None) -> int:
    command = shlex.join(["python", "bench/soak.py", *(sys.argv[1:] if argv is None else argv)])
    argv = sys.argv[1:] if argv is None else argv
    server_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, server_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else --launch)")
    p.add_argument("--launch", action="store_true", help="start clef-systemone with the arguments after --")
    p.add_argument("--pid", type=int, help="the server's pid, for RSS (set by --launch)")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    p.add_argument("--idle", type=float, default=0.0,
                   help="seconds after the load without it, still sampling: does RSS come back down? (default 0)")
    p.add_argument("--warmup", type=float, default=0.0,
                   help="seconds of load before --duration's, then --quiet seconds without load: the warm RSS is "
                        "taken at their end (default 0: none)")
    p.add_argument("--quiet", type=float, default=10.0, help="seconds without load after the warm-up (default 10)")
    p.add_argument("--mix", choices=("normal", "adversarial", "media"), default="normal",
                   help="adversarial: the load plus every hostile client of the Attacks table, each checked "
                        "against its documented answer; --launch adds MIX_SERVER_FLAGS not given after --; "
                        "media: the same with hostile and valid images instead (Attacks.media)")
    p.add_argument("--attackers", type=int, default=3, help="attack tasks at once with --mix adversarial (default 3)")
    p.add_argument("--concurrency", type=int, default=0,
                   help="clients; default 2 x the server's clef_max_in_flight (engine full, queue never empty)")
    p.add_argument("--sample-every", type=float, default=1.0, help="seconds between RSS and loop-lag samples")
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
    adversarial = args.mix in ("adversarial", "media")
    if adversarial and args.launch:
        for flag, value in MIX_SERVER_FLAGS.items():
            if not any(a == flag or a.startswith(flag + "=") for a in server_args):
                server_args += [flag, value]

    proc, server = None, None
    log_path = Path(args.server_log) if args.server_log else Path(tempfile.mkdtemp(prefix="clef-soak-")) / "server.log"
    if args.launch:
        server = launch(server_args, log_path, args.ready_timeout)
        proc, args.url, args.pid = server.proc, server.url, server.pid
    args.url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    encoder = None
    if args.tokenizer:
        from clef_vllm.model.demo import resolve_model_dir
        from clef_vllm.schema.encoding import RequestEncoder

        encoder = RequestEncoder.from_pretrained(resolve_model_dir(args.tokenizer), max_length=args.max_model_len)
    before = scrape(args.url, headers)
    if not args.concurrency:
        args.concurrency = max(2, int(2 * before.get("clef_max_in_flight", 16)))
    try:
        model_info = httpx.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    except (httpx.HTTPError, KeyError, ValueError):
        model_info = {}
    sampler = MemorySampler(args.pid)
    watcher = Watcher(args.url, headers, sampler, every=args.sample_every)
    soak = Soak(args, encoder)
    runner = None
    if adversarial:
        eff = server_args if args.launch else []
        host_port = args.url.split("//", 1)[1]
        attacks = Attacks(host_port.rsplit(":", 1)[0], int(host_port.rsplit(":", 1)[1]), headers,
                          max_connections=int(flag_value(eff, "--max-connections", MIX_SERVER_FLAGS["--max-connections"])),
                          header_timeout=float(flag_value(eff, "--header-timeout", MIX_SERVER_FLAGS["--header-timeout"])),
                          body_timeout=float(flag_value(eff, "--body-timeout", MIX_SERVER_FLAGS["--body-timeout"])),
                          max_body_bytes=int(flag_value(eff, "--max-body-bytes", MIX_SERVER_FLAGS["--max-body-bytes"])),
                          max_bulk_lines=int(flag_value(eff, "--max-bulk-lines", MIX_SERVER_FLAGS["--max-bulk-lines"])))
        attacks.others = args.concurrency + 4 + args.attackers + 2       # the load's pool, attackers, the watcher
        attacks.answer_timeout = args.client_timeout
        if args.mix == "media":
            attacks.table = attacks.media
        runner = AttackRunner(attacks, args.attackers, args.seed)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load0 = os.getloadavg()[0]
    print(f"soak: {args.url} for {args.duration:g} s at concurrency {args.concurrency}"
          f"{f' with the {args.mix} mix' if adversarial else ''}", flush=True)
    phases = asyncio.run(soak.run(watcher, runner))
    elapsed = phases["load_end_s"] - phases["load_start_s"]
    after = scrape(args.url, headers)
    errors_5xx = server_errors(args.url, headers)
    exit_code = None
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = "killed after 120 s"
    log_text = log_path.read_text(errors="replace") if proc is not None else ""

    rss, gpu = sampler.summary(1), sampler.summary(2)
    attack_results = runner.summary() if runner else {}
    attack_bad = {k: sum(r[k] for r in attack_results.values()) for k in ("unexpected", "lost", "misattributed")}
    ids = check_log(log_text, soak.attempts) if proc is not None and '"logger"' in log_text else None
    lost = soak.counts["lost"] + soak.bulk["lost"] + attack_bad["lost"]
    misattributed = (soak.counts["mismatched"] + soak.bulk["mismatched"] + attack_bad["misattributed"]
                     + (ids["misattributed"] if ids else 0))
    responses_5xx = int(sum(errors_5xx.values())) + sum(int(k) >= 500 for k in soak.errors if k.isdigit())
    failed = lost + misattributed + attack_bad["unexpected"] + responses_5xx
    load_end = phases["load_end_s"]
    # quiet against quiet: the warm RSS at the end of the pause after the warm-up, the end RSS 5-10 s
    # after the load (its last answers out), the idle RSS over the idle time's last 10 s
    rss_warm = watcher.rss_between(phases["warm_s"] - 5, phases["warm_s"]) if "warm_s" in phases else None
    rss_end = watcher.rss_between(load_end + 5, load_end + 10) if args.idle >= 10 else None
    rss_idle = watcher.rss_between(phases["end_s"] - 10, phases["end_s"]) if args.idle >= 10 else None
    rss_peak = max((v for _, v, _ in sampler.series if v is not None), default=None)
    rss_peak = None if rss_peak is None else round(rss_peak, 1)
    loop_lag_p99 = watcher.lag_p99_ms(phases["load_start_s"], load_end)
    health = watcher.health_ms()
    requests_total = (soak.counts["sent"] + soak.bulk["streams"] + sum(r["runs"] for r in attack_results.values()))
    memory_flat = all(m is None or m["flat"] for m in (rss, gpu))
    targets = None
    if adversarial:
        targets = {
            "no_responses_ge_500": responses_5xx == 0,
            "none_lost_or_misattributed": lost == 0 and misattributed == 0,
            "every_attack_answered_as_documented": attack_bad["unexpected"] == 0,
            "rss_end_within_150mb_of_warm": None if None in (rss_end, rss_warm) else rss_end - rss_warm <= 150,
            "rss_idle_within_100mb_of_warm": None if None in (rss_idle, rss_warm) else rss_idle - rss_warm <= 100,
            "loop_lag_p99_le_50ms": None if loop_lag_p99 is None else loop_lag_p99 <= 50,
            "health_p99_le_50ms": health.get("p99") is not None and health["p99"] <= 50 and not health["failed"],
        }
    summary = {
        "minutes": round(elapsed / 60, 2), "requests": requests_total, "responses_5xx": responses_5xx, "lost": lost,
        "misattributed": misattributed,
        "rss_warm_mb": rss_warm, "rss_peak_mb": rss_peak, "rss_end_mb": rss_end, "rss_idle_mb": rss_idle,
        "loop_lag_p99_ms": loop_lag_p99, "health_p99_ms": health.get("p99"), "command": command,
        "targets": targets, "pass": None if targets is None else all(v is not False for v in targets.values()),
        "label": args.label, "started_at": started, "url": args.url, "server": model_info,
        "server_args": server_args if args.launch else None, "mix": args.mix,
        "machine": f"{os.cpu_count()} cores (1-min load average at the start: {load0:.1f})",
        "duration_s": round(elapsed, 1), "idle_s": args.idle, "warmup_s": args.warmup, "quiet_s": args.quiet,
        "phases_s": {k: round(v, 1) for k, v in phases.items()}, "concurrency": args.concurrency,
        "requests_detail": {**soak.counts, "errors": soak.errors}, "bulk": soak.bulk, "attacks": attack_results,
        "request_ids_in_log": ids, "server_5xx": errors_5xx,
        "answered_per_s": round((soak.counts["ok"] + soak.counts["expected_errors"] + soak.bulk["ok"]) / elapsed, 2),
        "latency_ms": distribution_ms(soak.latencies), "health_live_ms": health,
        "loop_lag_p99_ms_per_minute": watcher.lag_p99_per_minute_ms(),
        "loop_lag_p99_ms_idle": watcher.lag_p99_ms(load_end + 10, phases["end_s"]) if args.idle >= 20 else None,
        "machine_load_avg_1min": {"mean": round(statistics.fmean(v for _, v in watcher.load), 2) if watcher.load
                                  else None, "max": round(max((v for _, v in watcher.load), default=0.0), 2),
                                  "cores": os.cpu_count()},
        "memory": {"rss_mb": rss, "gpu_mb": gpu, "series_t_rss_gpu": sampler.series},
        "server_metrics_delta": {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in sorted(after)},
        "input_tokens_checked_locally": encoder is not None,
        "server_exit_code": exit_code,
        "server_log": str(log_path) if proc is not None else None,
        "examples": soak.examples,
        "memory_flat": memory_flat,
    }
    summary["verdict"] = "pass" if failed == 0 and summary["pass"] is not False and (
        memory_flat or not args.fail_on_memory) else "fail"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: summary[k] for k in ("minutes", "requests", "responses_5xx", "lost", "misattributed",
                                               "rss_warm_mb", "rss_peak_mb", "rss_end_mb", "rss_idle_mb",
                                               "loop_lag_p99_ms", "health_p99_ms", "targets", "verdict")}, indent=1),
          flush=True)
    if attack_bad["unexpected"] or attack_bad["lost"] or attack_bad["misattributed"]:
        print(json.dumps({k: v for k, v in attack_results.items() if v["ok"] != v["runs"]}, indent=1), flush=True)
    return 0 if summary["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())

"""Closed-loop async load: ``C`` workers each send one request, wait for it, and send the next.

:func:`closed_loop` is the engine both tools share; :class:`HttpSender` posts SystemOne bodies
with aiohttp; :func:`summarize_point` turns one sweep point's outcomes into the reported numbers.
Latency is measured from just before the request is handed to the client until the whole
response body has arrived (JSON decoding and checks happen after the clock stops).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

from clef_vllm.bench.workloads import BenchRequest

T = TypeVar("T")
R = TypeVar("R")

SYSTEMONE_PATH = "/v1/systemone"


@dataclass
class Outcome:
    """What happened to one request. ``status`` is the HTTP status as a string, or an error kind
    (``timeout``, ``connect_error``, ``bad_response``, ``engine_error``, an aiohttp client error name)."""

    status: str
    latency_s: float
    input_tokens: int | None = None     # as reported by the server (usage.input_tokens)
    cached_tokens: int | None = None    # usage.cached_state_tokens (tokens read from the state cache)
    server_ms: float | None = None      # Server-Timing total, when the server sends one
    error: str | None = None
    server_stages: dict[str, float] | None = None   # every Server-Timing metric (ms), ``total`` included

    @property
    def ok(self) -> bool:
        return self.status == "200"


async def closed_loop(items: Sequence[T], concurrency: int, call: Callable[[T], Awaitable[R]], *,
                      time_limit: float | None = None, on_done: Callable[[], None] | None = None,
                      ) -> tuple[list[R | None], float]:
    """Run ``call`` over ``items`` with ``concurrency`` workers; results in item order.

    With ``time_limit`` (seconds) no new item starts after the limit; items never started stay
    ``None``. Returns ``(results, wall seconds from first send to last completion)``.
    """
    results: list[R | None] = [None] * len(items)
    next_index = 0
    started = time.perf_counter()

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(items):
            if time_limit is not None and time.perf_counter() - started > time_limit:
                return
            i = next_index
            next_index += 1
            results[i] = await call(items[i])
            if on_done is not None:
                on_done()

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(items) or 1)))))
    return results, time.perf_counter() - started


def systemone_url(url: str) -> str:
    """Accept a base URL (``http://host:8000``) or the full endpoint URL."""
    url = url.rstrip("/")
    return url if url.endswith(SYSTEMONE_PATH) else url + SYSTEMONE_PATH


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len(SYSTEMONE_PATH)] if url.endswith(SYSTEMONE_PATH) else url


def unwrap_envelope(body: Any) -> Any:
    """The bare SystemOne body from a Workers-AI style ``{result, success, errors, messages}`` envelope."""
    if isinstance(body, dict) and "result" in body and "success" in body and "answers" not in body:
        return body["result"]
    return body


_SERVER_TIMING = re.compile(r"(?:^|,)\s*([A-Za-z0-9_.-]+)\s*;[^,]*?dur=([0-9.]+)")


def server_timing(header: str | None) -> dict[str, float]:
    """The metrics of a ``Server-Timing`` header (``name;dur=ms``), in ms; empty without one."""
    return {m.group(1): float(m.group(2)) for m in _SERVER_TIMING.finditer(header or "")}


def server_total_ms(header: str | None) -> float | None:
    """The ``total`` metric of a ``Server-Timing`` header, in ms."""
    return server_timing(header).get("total")


#: The server's API key variable (``clef-systemone``): the tools send its first key unless told otherwise.
API_KEY_ENV = "CLEF_API_KEY"


def parse_headers(pairs: Sequence[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``["Authorization: Bearer x", ...]`` -> dict. Without an ``Authorization`` header among them, the
    first key of ``$CLEF_API_KEY`` (the server's own variable, comma-separated keys) is sent as Bearer."""
    out = {}
    for p in pairs:
        name, sep, value = p.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"header must look like 'Name: value', got {p!r}")
        out[name.strip()] = value.strip()
    key = next((k.strip() for k in (os.environ if environ is None else environ).get(API_KEY_ENV, "").split(",")
                if k.strip()), None)
    if key and not any(name.lower() == "authorization" for name in out):
        out["Authorization"] = f"Bearer {key}"
    return out


def wait_ready(url: str, seconds: float, headers: dict) -> str:
    """Poll ``GET /health`` until it says 200 (returns ``"ok"``) or 404 (``"no-health-route"``: a server
    without the route); raises TimeoutError after ``seconds``."""
    import httpx

    deadline = time.monotonic() + seconds
    last = "no answer"
    while True:
        try:
            r = httpx.get(base_url(url) + "/health", timeout=5.0, headers=headers)
            if r.status_code == 200:
                return "ok"
            if r.status_code == 404:
                return "no-health-route"
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} not ready after {seconds:.0f}s ({last})")
        time.sleep(1.0)

class HttpSender:
    """Posts :class:`BenchRequest` payloads to one ``/v1/systemone`` URL over a pooled aiohttp session.

    aiohttp, not httpx: with 64 open connections httpx's async pool cost ~7 ms of client CPU per
    request, so the client saturates before the server does (121 req/s at c=64 against
    ``bench/instant_server.py`` on 2 cores; aiohttp 810 req/s: bench/results/cpu_loadgen_aiohttp_instant.json).
    ``client_cpu_s`` in the results shows whether the client kept up.
    """

    def __init__(self, url: str, *, concurrency: int, timeout: float = 600.0, headers: dict | None = None):
        import aiohttp

        self.url = systemone_url(url)
        self._aiohttp = aiohttp
        self._timeout = timeout
        self._concurrency = concurrency
        self._headers = {"content-type": "application/json", **(headers or {})}
        self._session = None

    def _client(self):
        if self._session is None:   # an aiohttp session must be created inside the running loop
            aiohttp = self._aiohttp
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._concurrency), headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self._timeout, sock_connect=min(self._timeout, 30.0)))
        return self._session

    async def send(self, req: BenchRequest) -> Outcome:
        aiohttp = self._aiohttp
        session = self._client()
        t0 = time.perf_counter()
        try:
            async with session.post(self.url, data=req.payload) as resp:
                raw = await resp.read()
                status, timing = resp.status, resp.headers.get("server-timing")
        except asyncio.TimeoutError:
            return Outcome("timeout", time.perf_counter() - t0, error="timed out")
        except aiohttp.ClientConnectorError as exc:
            return Outcome("connect_error", time.perf_counter() - t0, error=str(exc)[:200])
        except aiohttp.ClientError as exc:
            return Outcome(type(exc).__name__, time.perf_counter() - t0, error=str(exc)[:200])
        latency = time.perf_counter() - t0
        stages = server_timing(timing) or None
        server_ms = stages.get("total") if stages else None
        if status != 200:
            return Outcome(str(status), latency, server_ms=server_ms, error=raw[:300].decode(errors="replace"))
        try:
            body = unwrap_envelope(json.loads(raw))
            answers = body["answers"]
            usage = body.get("usage", {})
            tokens, cached = usage.get("input_tokens"), usage.get("cached_state_tokens")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return Outcome("bad_response", latency, server_ms=server_ms, error=f"unreadable body: {exc}"[:300])
        if not isinstance(answers, dict) or len(answers) != req.questions:
            return Outcome("bad_response", latency, server_ms=server_ms,
                           error=f"{len(answers) if isinstance(answers, dict) else '?'} answers for "
                                 f"{req.questions} questions")
        return Outcome("200", latency, input_tokens=tokens if isinstance(tokens, int) else None,
                       cached_tokens=cached if isinstance(cached, int) else None, server_ms=server_ms,
                       server_stages=stages)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution_ms(values_s: Sequence[float], scale: float = 1000.0) -> dict | None:
    """p50 / p90 / p99 (:func:`percentile`), mean, min and max of durations in seconds, as milliseconds."""
    if not values_s:
        return None
    v = [x * scale for x in values_s]
    return {"p50": round(percentile(v, 50), 3), "p90": round(percentile(v, 90), 3),
            "p99": round(percentile(v, 99), 3), "mean": round(sum(v) / len(v), 3),
            "min": round(min(v), 3), "max": round(max(v), 3)}


def summarize_point(variant: str, concurrency: int, requests: Sequence[BenchRequest],
                    outcomes: Sequence[Outcome | None], wall_s: float, *, client_cpu_s: float | None = None,
                    max_examples: int = 5) -> dict:
    """One sweep point's numbers (see docs/bench.md for each field)."""
    done = [(r, o) for r, o in zip(requests, outcomes) if o is not None]
    ok = [(r, o) for r, o in done if o.ok]
    errors = Counter(o.status for _, o in done if not o.ok)
    unexpected = sum(1 for r, o in done if o.status != str(r.expected_status))
    error_examples = [{"request": r.label, "status": o.status, "error": o.error}
                      for r, o in done if not o.ok][:max_examples]

    checked = [(r, o) for r, o in ok if r.expected_tokens is not None and o.input_tokens is not None]
    mismatched = [(r, o) for r, o in checked if r.expected_tokens != o.input_tokens]
    tokens_in = sum((o.input_tokens if o.input_tokens is not None else (r.expected_tokens or 0)) for r, o in ok)
    questions = sum(r.questions for r, _ in ok)
    wall = max(wall_s, 1e-9)
    server = [o.server_ms / 1000.0 for _, o in ok if o.server_ms is not None]
    expected = [r.expected_tokens for r in requests if r.expected_tokens is not None]
    reported = sum(o.input_tokens for _, o in ok if o.input_tokens is not None)
    cached = [o.cached_tokens for _, o in ok if o.cached_tokens is not None]
    return {
        "variant": variant,
        "concurrency": concurrency,
        "requests": len(requests),
        "sent": len(done),
        "ok": len(ok),
        "errors": dict(sorted(errors.items())),
        "unexpected_status": unexpected,
        "duration_s": round(wall_s, 4),
        "req_per_s": round(len(ok) / wall, 4),
        "input_tok_per_s": round(tokens_in / wall, 2),
        "questions_per_s": round(questions / wall, 4),
        "latency_ms": distribution_ms([o.latency_s for _, o in ok]),
        "server_ms": distribution_ms(server),
        # where the server's time went (its Server-Timing stages: parse, queue, encode, engine, ...), p50 each
        "server_stages_p50_ms": stage_medians([o.server_stages for _, o in ok if o.server_stages]),
        "input_tokens": {
            "mean_expected": round(sum(expected) / len(expected), 1) if expected else None,
            "total_reported": reported,
            # the state cache: tokens the server read instead of computing (usage.cached_state_tokens),
            # the share of the reported tokens they make up, and how many requests read any
            "cached": sum(cached) if cached else 0,
            "cached_share": round(sum(cached) / reported, 4) if cached and reported else 0.0,
            "requests_with_hits": sum(1 for c in cached if c > 0),
            "checked": len(checked),
            "mismatches": len(mismatched),
            "mismatch_examples": [{"request": r.label, "expected": r.expected_tokens, "reported": o.input_tokens}
                                  for r, o in mismatched[:max_examples]],
        },
        "error_examples": error_examples,
        "client_cpu_s": None if client_cpu_s is None else round(client_cpu_s, 3),
    }


def stage_medians(timings: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per Server-Timing stage, the median over the requests that reported it (ms)."""
    names = sorted({name for t in timings for name in t})
    return {name: round(percentile([t[name] for t in timings if name in t], 50), 3) for name in names}


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False)

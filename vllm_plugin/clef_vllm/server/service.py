"""The decision pipeline behind both endpoints, and the server's life cycle.

One decision: parse -> admission (engine slot) -> encode -> length policy -> engine -> answers.
Every step records its stage time on the request's :class:`RequestContext`. Life cycle:
``loading`` -> ``ready`` -> ``draining`` (SIGTERM: finish what was accepted, refuse the rest)
or ``failed`` (load failed, or the engine died: refuse everything and let the CLI exit non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator

from clef_vllm.backends.base import REQUEST_STATS, Backend, BackendDeadError, RequestStats
from clef_vllm.schema.answers import build_response, hosted_envelope
from clef_vllm.schema.dialects import parse_request
from clef_vllm.schema.errors import ClefError, ClientClosed, Kind, RequestError, ServiceError
from clef_vllm.schema.media import HOSTED_MAX_BODY_BYTES, decode_media, host_bytes
from clef_vllm.schema.openai_decisions import check_fits
from clef_vllm.schema.protocol import Dialect, RequestLimits, SystemOneRequest
from clef_vllm.server.admission import BULK, INTERACTIVE, Admission, MemoryBudget, QueueFull
from clef_vllm.server.body import BodyReader, decode_json, declared_length
from clef_vllm.server.context import RequestContext
from clef_vllm.server.cpu_pool import TRIM_AFTER_BYTES, CpuPool, Trimmer, default_cpu_workers
from clef_vllm.server.loop_lag import INTERVAL_S, watch_loop_lag
from clef_vllm.server.metrics import ServerMetrics
from clef_vllm.server.settings import ServerSettings
from clef_vllm.util.heap import LONG_PAUSE_LINE, FullCollections, freeze_heap

log = logging.getLogger("clef_vllm.server")

#: How long, after the shutdown timeout, requests get to send their 503 before the exit.
ABANDON_GRACE_S = 0.5


LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"


class DecisionService:
    """Owns the backend, admission control, metrics and the server state."""

    def __init__(self, settings: ServerSettings, metrics: ServerMetrics):
        self.settings = settings
        self.metrics = metrics
        self.dialect: Dialect = settings.dialect
        self.backend: Backend | None = None
        self.admission: Admission | None = None
        self.status = LOADING
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.active = 0                     # API requests and bulk streams being handled
        self.bulk_streams = 0
        self.bulk_records_in_progress = 0
        self._fatal: asyncio.Future | None = None
        self._idle: asyncio.Event | None = None
        self.stopping: asyncio.Event | None = None     # set on drain or failure: bulk streams stop reading
        self.abandon: asyncio.Event | None = None      # the shutdown timeout passed: answer everything now
        self.abandon_cause = "--shutdown-timeout"      # or "a second SIGTERM" (abandon_now)
        self._tasks: list[asyncio.Task] = []
        self._loop_watchers: list = []           # concurrent futures of the watchers on the backend's own loops
        self._closing = False
        self.limits: RequestLimits | None = None
        self.pool = CpuPool(settings.cpu_workers or default_cpu_workers(), settings.cpu_inline_bytes)
        self.trimmer = Trimmer(self.pool)
        self.buffered_bytes = 0                          # request bodies held in memory
        self.media_memory = MemoryBudget(settings.max_media_memory)   # the decoded media of requests in progress
        # objects out of the full collections, counted once (``gc.get_freeze_count()`` walks them all: ~40 ms of
        # the event loop for start-up's ~400,000 on 2 cores, so a /metrics scrape must not count them again)
        self.frozen_objects = gc.get_freeze_count()
        self._install_gauges()

    # ------------------------------------------------------------------ life cycle

    def _install_gauges(self) -> None:
        m = self.metrics
        m.gauge("clef_ready", "1 when serving", lambda: float(self.status == READY))
        m.gauge("clef_draining", "1 while shutting down gracefully", lambda: float(self.status == DRAINING))
        m.gauge("clef_failed", "1 once the model failed to load or the engine died", lambda: float(self.status == FAILED))
        m.gauge("clef_in_flight", "Requests holding an engine slot",
                lambda: float(self.admission.in_flight if self.admission else 0))
        m.gauge("clef_queue_depth", "Interactive requests waiting for an engine slot",
                lambda: float(self.admission.waiting(INTERACTIVE) if self.admission else 0))
        m.gauge("clef_bulk_queue_depth", "Bulk records waiting for an engine slot",
                lambda: float(self.admission.waiting(BULK) if self.admission else 0))
        m.gauge("clef_max_in_flight", "Engine slots (--max-in-flight)",
                lambda: float(self.admission.max_in_flight if self.admission else 0))
        m.gauge("clef_max_queue", "Interactive wait-queue bound (--max-queue)",
                lambda: float(self.admission.max_queue if self.admission else 0))
        m.gauge("clef_bulk_streams", "Open bulk streams", lambda: float(self.bulk_streams))
        m.gauge("clef_bulk_records_in_progress", "Bulk records read and not yet answered",
                lambda: float(self.bulk_records_in_progress))
        m.gauge("clef_gc_frozen_objects", "Objects kept out of the garbage collector's scans since start-up "
                "(counted when frozen, not at each scrape)", lambda: float(self.frozen_objects))
        m.gauge("clef_gc_full_collections", "Full (generation 2) garbage collections in this process",
                lambda: float(gc.get_stats()[2]["collections"]))
        if self.settings.gc_metrics:
            pauses = FullCollections(on_long=self._long_gc_pause).install()
            m.gauge("clef_gc_pause_seconds", "Time this process spent in full garbage collections since the "
                    "server started (the event loop stops meanwhile)", lambda: pauses.seconds)
        m.gauge("clef_cpu_jobs", "Jobs (decode, validate, encode, serialise) queued or running in the CPU pool",
                lambda: float(self.pool.queued))
        m.gauge("clef_buffered_body_bytes", "Request body bytes held in memory", lambda: float(self.buffered_bytes))
        m.gauge("clef_media_memory_bytes", "Host memory the media of requests in progress are budgeted at "
                "(--max-media-memory)", lambda: float(self.media_memory.held))
        m.gauge("clef_media_waiting", "Requests with media waiting for --max-media-memory",
                lambda: float(self.media_memory.waiting))

    def _long_gc_pause(self, ms: float, freed: int) -> None:
        """A full garbage collection of ``ms`` (at least :data:`clef_vllm.util.heap.LONG_PAUSE_MS`) stopped the event
        loop: say so once serving (the load's and the freeze's own collections are expected)."""
        if self.status in (READY, DRAINING):
            log.warning(LONG_PAUSE_LINE + " for %.0f ms (it freed %d unreachable objects; %d frozen objects not "
                        "walked)", ms, freed, self.frozen_objects)

    async def run(self, load_backend: Callable[[], Backend]) -> None:
        """Load the backend (in a thread), start it, then watch its health until the loop ends."""
        self.loop = asyncio.get_running_loop()
        self._fatal = self.loop.create_future()
        self._idle = asyncio.Event()
        self._idle.set()
        self.stopping = asyncio.Event()
        self.abandon = asyncio.Event()
        t0 = time.perf_counter()
        try:
            backend = await asyncio.wait_for(self._load(load_backend), self.settings.load_timeout_s)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported through /health and the exit code
            if isinstance(exc, asyncio.TimeoutError):
                exc = TimeoutError(f"the model did not load within {self.settings.load_timeout_s:g} s (--load-timeout)")
            self.status, self.error = FAILED, exc
            log.error("model failed to load: %s", exc)
            if self.settings.on_load_error is not None:
                self.settings.on_load_error(exc)
            return
        self.metrics.load_seconds.set(time.perf_counter() - t0)
        self.backend = backend
        in_flight = self.settings.max_in_flight or max(1, int(backend.suggested_max_in_flight()))
        queue = self.settings.max_queue if self.settings.max_queue is not None else 2 * in_flight
        self.admission = Admission(in_flight, queue)
        self.limits = dataclasses.replace(backend.encoder.request_limits(), media=backend.media_limits(self.settings.media))
        if self.settings.freeze_heap:
            frozen, took_ms = freeze_heap()
            self.frozen_objects = frozen
            log.info("garbage collector: %d objects from start-up frozen (a full collection over them took %.0f ms "
                     "and stopped the event loop for as long)", frozen, took_ms)
        if self.status == LOADING:
            self.status = READY
        log.info("ready: %s; max in flight %d, queue %d, request timeout %s s, %d CPU workers; limits: %s",
                 backend.describe(), in_flight, queue, self.settings.request_timeout_s, self.pool.workers, self.limits)
        if self.settings.on_ready is not None:
            self.settings.on_ready()
        self._watch_loops(backend)
        await self._watch_health()

    def _watch_loops(self, backend: Backend) -> None:
        """Watch how late this loop's timers run, and the backend's own loops' (``clef_event_loop_lag_seconds``)."""
        def serving() -> bool:
            return self.status in (READY, DRAINING) and not self._closing

        lag = self.metrics.loop_lag
        self._tasks.append(self.loop.create_task(watch_loop_lag(lag.labels("http").observe, serving, "http")))
        for name, loop in backend.event_loops().items():
            self._loop_watchers.append(asyncio.run_coroutine_threadsafe(
                watch_loop_lag(lag.labels(name).observe, serving, name), loop))

    async def _load(self, load_backend: Callable[[], Backend]) -> Backend:
        backend = await in_daemon_thread(load_backend)
        await backend.start()
        return backend

    async def _watch_health(self) -> None:
        while self.status in (READY, DRAINING):
            try:
                await in_daemon_thread(self.backend.check_health)
            except BackendDeadError as exc:
                self.fail(exc)
                return
            except Exception as exc:  # noqa: BLE001 - a failing probe is not a dead engine
                log.warning("engine health check raised: %s", exc)
            await asyncio.sleep(self.settings.health_poll_s)

    def fail(self, exc: BaseException) -> None:
        """The engine can no longer serve: refuse new requests, fail the ones in the engine at once,
        then (once every open request is answered, at most ``shutdown_timeout_s``) call ``on_fatal``
        so the CLI exits non-zero."""
        if self.status == FAILED:
            return
        self.status, self.error = FAILED, exc
        log.error("engine failed: %s; refusing requests, exiting once open requests are answered", exc)
        if not self._fatal.done():
            self._fatal.set_result(exc)
        self.stopping.set()
        self._tasks.append(asyncio.get_running_loop().create_task(self._finish_then(self.settings.on_fatal, exc)))

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests (503), finish accepted ones, then call ``on_drained``."""
        if self.status in (DRAINING, FAILED):
            return
        was_loading = self.status == LOADING
        self.status = DRAINING
        self.stopping.set()
        log.info("draining: %d request(s) in flight; new requests get 503", self.active)
        if was_loading:                      # nothing was accepted: stop now
            if self.settings.on_drained is not None:
                self.settings.on_drained()
            return
        self._tasks.append(asyncio.get_running_loop().create_task(self._finish_then(self.settings.on_drained)))

    def abandon_now(self, why: str, cause: str = "--shutdown-timeout") -> None:
        """Answer every open request and upload 503 now and cancel its work (the shutdown timeout
        passed, or a second SIGTERM: ``cause`` is what their error names)."""
        if self.abandon is None or self.abandon.is_set():
            return
        self.abandon_cause = cause
        log.warning("%s: %d open request(s) are answered 503 and abandoned", why, self.active)
        self.abandon.set()

    async def _finish_then(self, callback: Callable | None, *args) -> None:
        """Wait until no request is open (at most ``shutdown_timeout_s``), then run ``callback``."""
        try:
            await asyncio.wait_for(self._idle.wait(), self.settings.shutdown_timeout_s)
            log.info("every accepted request was answered")
        except asyncio.TimeoutError:
            self.abandon_now(f"shutdown timeout ({self.settings.shutdown_timeout_s:g} s)")
            try:
                await asyncio.wait_for(self._idle.wait(), ABANDON_GRACE_S)
            except asyncio.TimeoutError:
                pass
        if callback is not None:
            callback(*args)

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for watcher in self._loop_watchers:      # they end at their next wake-up, before the backend stops their loops
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.wrap_future(watcher), 4 * INTERVAL_S)
        self.pool.close()
        if self.backend is not None:
            backend, self.backend = self.backend, None
            # After the shutdown timeout nothing waits for a batch still running (its thread is a daemon).
            wait = 1.0 if self.abandon is not None and self.abandon.is_set() else 30
            try:
                await asyncio.wait_for(in_daemon_thread(backend.close), wait)
            except Exception as exc:  # noqa: BLE001
                log.warning("backend close: %s", str(exc) or type(exc).__name__)

    # ------------------------------------------------------------------ admission of HTTP requests

    def check_accepting(self) -> None:
        """Raise 503 unless new work can be accepted."""
        if self.status == READY:
            return
        if self.status == LOADING:
            raise ServiceError("model is not ready", kind=Kind.NOT_READY)
        if self.status == DRAINING:
            raise ServiceError("server is shutting down", kind=Kind.DRAINING)
        if self.backend is None:
            raise ServiceError("model failed to load", kind=Kind.LOAD_FAILED)
        raise ServiceError(f"engine failed: {self.error}", kind=Kind.ENGINE_DEAD)

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count an accepted request or stream until it is answered (graceful shutdown waits for 0)."""
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    def overloaded(self) -> ServiceError:
        retry = self.admission.retry_after() if self.admission else 1
        return ServiceError(f"server is at capacity ({self.admission.in_flight} in flight, "
                            f"{self.admission.waiting()} queued); retry after {retry} s", kind=Kind.OVERLOADED,
                            retry_after=retry)

    # ------------------------------------------------------------------ request bodies

    def body_reader(self, receive: Callable[[], Awaitable[dict]]) -> BodyReader:
        s = self.settings
        reader = BodyReader(receive, body_timeout=s.body_timeout_s, min_rate=s.min_body_rate, stopping=self.stopping,
                            abandon=self.abandon)
        reader.stopping_error = self._stalled_while_stopping
        return reader

    def _stalled_while_stopping(self) -> ServiceError:
        if self.status == FAILED:
            return ServiceError(f"engine failed: {self.error}; the request body stalled", kind=Kind.ENGINE_DEAD)
        return ServiceError("server is shutting down; the request body stalled", kind=Kind.DRAINING)

    @contextmanager
    def holding_body(self, ctx: RequestContext) -> Iterator[None]:
        """Account for a request's body while it is in memory; a large one is followed by a trim."""
        try:
            yield
        finally:
            self.buffered_bytes -= ctx.body_bytes
            if ctx.body_bytes >= TRIM_AFTER_BYTES:
                self.trimmer.request()

    def take_body_bytes(self, ctx: RequestContext, n: int) -> None:
        """Refuse (429) a body that would push the bodies held in memory past the budget."""
        budget = self.settings.max_buffered_bytes
        if budget is not None and self.buffered_bytes + n > budget and self.buffered_bytes > 0:
            raise ServiceError(f"the server holds {self.buffered_bytes} bytes of request bodies; retry shortly",
                               kind=Kind.OVERLOADED, retry_after=1)
        self.buffered_bytes += n
        ctx.body_bytes += n

    async def read_body(self, receive: Callable[[], Awaitable[dict]], ctx: RequestContext,
                        declared: str | None) -> bytes:
        """The whole body under the size cap, the slow-client rules and the memory budget."""
        limit, source = self.settings.max_body_bytes, "--max-body-bytes"
        if (ctx.dialect or self.dialect) is Dialect.WORKERS_AI and HOSTED_MAX_BODY_BYTES < limit:
            limit, source = HOSTED_MAX_BODY_BYTES, "the hosted API's 13 MiB"
        length = declared_length(declared, limit, source)
        if length is not None:
            self.take_body_bytes(ctx, length)
        reader = self.body_reader(receive)
        raw = await reader.read_all(limit, declared, self.limits, source)      # too many JSON values: 413 early
        ctx.values_counted = True
        if ctx.body_bytes < len(raw):
            self.take_body_bytes(ctx, len(raw) - ctx.body_bytes)
        return raw

    # ------------------------------------------------------------------ one decision

    def _parse(self, raw: bytes | str | Any, ctx: RequestContext, dialect: Dialect) -> SystemOneRequest:
        limits = self.limits
        body = decode_json(raw, limits, ctx.checkpoint, ctx.values_counted) if isinstance(raw, (bytes, str)) else raw
        ctx.checkpoint()
        if ctx.default_model is not None and isinstance(body, dict) and "model" not in body:
            body = {"model": ctx.default_model, **body}
        return parse_request(body, dialect, limits)

    async def answer(self, raw: bytes | list | Any, ctx: RequestContext, kind: str = INTERACTIVE) -> dict:
        """The response body for a request body (bytes, or already decoded), or a ClefError. A body
        given in a one-item list is taken out of it, so nothing keeps it alive once it is parsed.
        The request's route decides the dialect (``ctx.dialect``; none: ``--dialect``) and may
        supply the ``model`` a body leaves out (``ctx.default_model``)."""
        t0 = time.perf_counter()
        dialect = ctx.dialect or self.dialect
        if isinstance(raw, list):
            raw = raw.pop()
        parsed = await self.pool.run(ctx, self._parse, raw, ctx, dialect)
        del raw
        ctx.add_stage("parse", time.perf_counter() - t0)
        async with self._media_decoded(parsed, ctx):
            ctx.questions = len(parsed.questions)
            encoded, probs = await self._admitted(parsed, ctx, kind)
            payload = await self.pool.run(ctx, build_response, parsed, encoded, probs, dialect)
        self.metrics.observe_decision(encoded, probs)
        self.metrics.observe_stages(kind, ctx.stages)
        return hosted_envelope(payload) if dialect is Dialect.WORKERS_AI else payload

    @contextlib.asynccontextmanager
    async def _media_decoded(self, parsed: SystemOneRequest, ctx: RequestContext):
        """For a request with media: hold their share of ``--max-media-memory`` (:func:`host_bytes`, from their
        headers; waiting for it counts as queueing, ``--request-timeout`` runs), then decode every frame once
        (corrupt data: 422) in the pool whatever the body's size, and keep the share until the answer."""
        if not parsed._media:
            yield
            return
        t0 = time.perf_counter()
        async with self.media_memory.hold(host_bytes(parsed._media)):
            t1 = time.perf_counter()
            ctx.add_stage("queue", t1 - t0)
            await self.pool.run(ctx, decode_media, parsed._media, ctx.checkpoint, inline=False)
            ctx.add_stage("parse", time.perf_counter() - t1)
            yield

    async def answer_unless_gone(self, raw: bytes, ctx: RequestContext,
                                 receive: Callable[[], Awaitable[dict]]) -> bytes:
        """:meth:`answer` as JSON bytes under ``--request-timeout``, cancelled (CPU work and engine call
        included) if the client goes away or the shutdown timeout passes first."""
        work = asyncio.ensure_future(self._with_timeout(self._answer_bytes([raw], ctx), ctx))
        del raw
        watchers = [asyncio.ensure_future(wait_for_disconnect(receive)), asyncio.ensure_future(self.abandon.wait())]
        try:
            await asyncio.wait({work, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            for watcher in watchers:
                watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            if watchers[0].done() and not watchers[0].cancelled():
                raise ClientClosed("client closed the connection before the answer was ready")
            raise ServiceError(f"server is shutting down; the request was not answered ({self.abandon_cause})",
                               kind=Kind.DRAINING)
        return work.result()

    async def _answer_bytes(self, box: list, ctx: RequestContext) -> bytes:
        payload = await self.answer(box, ctx)
        return await self.pool.run(ctx, render_json, payload)

    async def _with_timeout(self, coro: Awaitable, ctx: RequestContext):
        if ctx.timeout_s is None:
            return await coro
        try:
            return await asyncio.wait_for(coro, ctx.timeout_s)
        except asyncio.TimeoutError:
            raise ServiceError(f"request did not finish within {ctx.timeout_s:g} s (--request-timeout) and was "
                               "cancelled", kind=Kind.TIMEOUT) from None

    async def _admitted(self, parsed: SystemOneRequest, ctx: RequestContext, kind: str):
        """Hold an engine slot while encoding and deciding. Bulk records wait for a slot without a
        deadline (their stream is the backpressure) and are timed from the moment they get one."""
        admission = self.admission
        t0 = time.perf_counter()
        try:
            await admission.acquire(kind)
        except QueueFull:
            raise self.overloaded() from None
        held = time.perf_counter()
        ctx.add_stage("queue", held - t0)
        try:
            work = self._encode_and_decide(parsed, ctx)
            return await (self._with_timeout(work, ctx) if kind == BULK else work)
        finally:
            admission.release(time.perf_counter() - held)

    async def _encode_and_decide(self, parsed: SystemOneRequest, ctx: RequestContext):
        t0 = time.perf_counter()
        encoded = await self.pool.run(ctx, self._encode, parsed, ctx)
        ctx.add_stage("encode", time.perf_counter() - t0)
        ctx.input_tokens = encoded.num_tokens
        probs = await self._engine(encoded, ctx)
        return encoded, probs

    def _encode(self, parsed: SystemOneRequest, ctx: RequestContext):
        encoded = self.backend.encoder.encode(parsed, checkpoint=ctx.checkpoint)
        parsed.state = None                  # the answer does not need it; a large state is freed now
        if (ctx.dialect or self.dialect) is Dialect.OPENAI:      # OpenAI's route never cuts the input
            check_fits(encoded)
        if encoded.truncated_state_tokens and self.settings.over_length == "reject":
            cut = encoded.truncated_state_tokens
            need, state = encoded.num_tokens + cut, encoded.state_tokens + cut
            about = "" if encoded.truncation_exact else "about "
            raise RequestError(f"request needs {about}{need} tokens (state {about}{state} + prompt and schema "
                            f"{need - state}); maximum is {encoded.num_tokens} (--max-model-len); "
                            "--over-length reject is set, so the state is not cut",
                            kind=Kind.TOO_MANY_TOKENS, field="state")
        return encoded

    async def _engine(self, encoded, ctx: RequestContext):
        stats = RequestStats()
        token = REQUEST_STATS.set(stats)
        try:
            task = asyncio.ensure_future(self.backend.decide(encoded))
        finally:
            REQUEST_STATS.reset(token)
        t0 = time.perf_counter()
        try:
            await asyncio.wait({task, self._fatal}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            self.metrics.cancellations.inc()
            raise
        finally:
            ctx.add_stage("engine", time.perf_counter() - t0)
        if not task.done():                  # the engine died while this request was in it
            task.cancel()
            raise ServiceError(f"engine failed: {self.error}", kind=Kind.ENGINE_DEAD)
        try:
            probs = task.result()
        except BackendDeadError as exc:
            self.metrics.engine_failures.labels("dead").inc()
            self.fail(exc)
            raise ServiceError(f"engine failed: {exc}", kind=Kind.ENGINE_DEAD) from None
        except ClefError:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine bug must not look like a client error
            self.metrics.engine_failures.labels(type(exc).__name__).inc()
            log.error("engine error: %s", exc, exc_info=exc)
            raise ServiceError(f"engine error: {type(exc).__name__}", kind=Kind.ENGINE_ERROR) from None
        if stats.batch_size:
            ctx.add_stage("batch_wait", stats.batch_wait_s)
            backbone = stats.stages.get("backbone")
            if backbone is not None:
                ctx.add_stage("backbone", backbone)
                ctx.add_stage("head", stats.run_s - backbone)
            if stats.first_in_batch:
                self.metrics.batch_size.observe(stats.batch_size)
        return probs


async def in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a daemon thread: a load or shutdown stuck in a dead engine never blocks the exit
    (``asyncio.to_thread`` workers are joined when the interpreter exits)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, exc):
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(result)

    def target():
        try:
            result, exc = fn(), None
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            result, exc = None, err
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:          # the loop is gone (the server exited meanwhile)
            pass

    threading.Thread(target=target, name=f"clef-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await fut


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return when the ASGI server reports that the client went away (body already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def render_json(payload: dict) -> bytes:
    """A response body as Starlette's JSONResponse writes it."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")

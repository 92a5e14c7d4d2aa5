"""The decision pipeline behind both endpoints, and the server's life cycle.

One decision: parse -> admission (engine slot) -> encode -> length policy -> engine -> answers.
Every step records its stage time on the request's :class:`RequestContext`. Life cycle:
``loading`` -> ``ready`` -> ``draining`` (SIGTERM: finish what was accepted, refuse the rest)
or ``failed`` (load failed, or the engine died: refuse everything and let the CLI exit non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator

from starlette.concurrency import run_in_threadpool

from clef_vllm.answers import build_response, hosted_envelope
from clef_vllm.backends.base import REQUEST_STATS, Backend, BackendDeadError, RequestStats
from clef_vllm.protocol import Dialect, RequestError, SystemOneRequest, parse_request
from clef_vllm.server.admission import BULK, INTERACTIVE, Admission, QueueFull
from clef_vllm.server.context import RequestContext, ServerError
from clef_vllm.server.metrics import ServerMetrics
from clef_vllm.server.settings import ServerSettings

log = logging.getLogger("clef_vllm.server")

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
        self._tasks: list[asyncio.Task] = []
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

    async def run(self, load_backend: Callable[[], Backend]) -> None:
        """Load the backend (in a thread), start it, then watch its health until the loop ends."""
        self.loop = asyncio.get_running_loop()
        self._fatal = self.loop.create_future()
        self._idle = asyncio.Event()
        self._idle.set()
        self.stopping = asyncio.Event()
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
        if self.status == LOADING:
            self.status = READY
        log.info("ready: %s; max in flight %d, queue %d, request timeout %s s", backend.describe(), in_flight, queue,
                 self.settings.request_timeout_s)
        if self.settings.on_ready is not None:
            self.settings.on_ready()
        await self._watch_health()

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

    async def _finish_then(self, callback: Callable | None, *args) -> None:
        """Wait until no request is open (at most ``shutdown_timeout_s``), then run ``callback``."""
        try:
            await asyncio.wait_for(self._idle.wait(), self.settings.shutdown_timeout_s)
            log.info("every accepted request was answered")
        except asyncio.TimeoutError:
            log.warning("shutdown timeout (%g s): %d open request(s) are abandoned",
                        self.settings.shutdown_timeout_s, self.active)
        if callback is not None:
            callback(*args)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.backend is not None:
            backend, self.backend = self.backend, None
            try:
                await asyncio.wait_for(in_daemon_thread(backend.close), 30)
            except Exception as exc:  # noqa: BLE001
                log.warning("backend close: %s", exc)

    # ------------------------------------------------------------------ admission of HTTP requests

    def check_accepting(self) -> None:
        """Raise 503 unless new work can be accepted."""
        if self.status == READY:
            return
        if self.status == LOADING:
            raise ServerError("model is not ready", status=503, reason="not_ready")
        if self.status == DRAINING:
            raise ServerError("server is shutting down", status=503, reason="draining")
        if self.backend is None:
            raise ServerError("model failed to load", status=503, reason="load_failed")
        raise ServerError(f"engine failed: {self.error}", status=503, reason="engine_failed")

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

    def overloaded(self) -> ServerError:
        retry = self.admission.retry_after() if self.admission else 1
        return ServerError(f"server is at capacity ({self.admission.in_flight} in flight, "
                           f"{self.admission.waiting()} queued); retry after {retry} s", status=429,
                           reason="queue_full", headers={"Retry-After": str(retry)})

    # ------------------------------------------------------------------ one decision

    def parse(self, body: Any, dialect: Dialect | None = None) -> SystemOneRequest:
        try:
            return parse_request(body, dialect or self.dialect)
        except RecursionError:
            raise RequestError("request is nested too deeply", status=400) from None

    async def answer(self, body: Any, ctx: RequestContext, kind: str = INTERACTIVE) -> dict:
        """The response body for a decoded request, or a RequestError/ServerError. The request's
        route decides the dialect (``ctx.dialect``; none: ``--dialect``) and may supply the
        ``model`` a body leaves out (``ctx.default_model``)."""
        dialect = ctx.dialect or self.dialect
        if ctx.default_model is not None and isinstance(body, dict) and "model" not in body:
            body = {"model": ctx.default_model, **body}
        parsed = self.parse(body, dialect)
        ctx.questions = len(parsed.questions)
        if kind == INTERACTIVE:
            encoded, probs = await self._with_timeout(self._admitted(parsed, ctx, kind), ctx)
        else:
            encoded, probs = await self._admitted(parsed, ctx, kind, timed=True)
        payload = build_response(parsed, encoded, probs, dialect)
        self.metrics.observe_decision(encoded, probs)
        self.metrics.observe_stages(kind, ctx.stages)
        return hosted_envelope(payload) if dialect is Dialect.WORKERS_AI else payload

    async def answer_unless_disconnected(self, body: Any, ctx: RequestContext,
                                         receive: Callable[[], Awaitable[dict]]) -> dict:
        """:meth:`answer`, cancelled (engine call included) if the client goes away first."""
        work = asyncio.ensure_future(self.answer(body, ctx))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            watcher.cancel()
        if not work.done():
            work.cancel()
            raise ServerError("client disconnected", status=499, reason="client_disconnected")
        return work.result()

    async def _with_timeout(self, coro: Awaitable, ctx: RequestContext):
        if ctx.timeout_s is None:
            return await coro
        try:
            return await asyncio.wait_for(coro, ctx.timeout_s)
        except asyncio.TimeoutError:
            raise ServerError(f"request did not finish within {ctx.timeout_s:g} s (--request-timeout) and was "
                              "cancelled", status=504, reason="timeout") from None

    async def _admitted(self, parsed: SystemOneRequest, ctx: RequestContext, kind: str, timed: bool = False):
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
            return await (self._with_timeout(work, ctx) if timed else work)
        finally:
            admission.release(time.perf_counter() - held)

    async def _encode_and_decide(self, parsed: SystemOneRequest, ctx: RequestContext):
        t0 = time.perf_counter()
        encoded = await run_in_threadpool(self._encode, parsed)
        ctx.add_stage("encode", time.perf_counter() - t0)
        ctx.input_tokens = encoded.num_tokens
        probs = await self._engine(encoded, ctx)
        return encoded, probs

    def _encode(self, parsed: SystemOneRequest):
        try:
            encoded = self.backend.encoder.encode(parsed)
        except RecursionError:
            raise RequestError("request is nested too deeply", status=400) from None
        except RequestError as exc:
            if exc.status == 413:          # the schema alone does not fit: always refused
                raise ServerError(exc.message, status=413, reason="schema_too_long", field=exc.field) from None
            raise
        if encoded.truncated_state_tokens and self.settings.over_length == "reject":
            cut = encoded.truncated_state_tokens
            need, state = encoded.num_tokens + cut, encoded.state_tokens + cut
            raise ServerError(f"request needs {need} tokens (state {state} + prompt and schema "
                              f"{need - state}); maximum is {encoded.num_tokens} (--max-model-len); "
                              "--over-length reject is set, so the state is not cut",
                              status=413, reason="too_many_tokens", field="state")
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
            raise ServerError(f"engine failed: {self.error}", status=503, reason="engine_failed")
        try:
            probs = task.result()
        except BackendDeadError as exc:
            self.metrics.engine_failures.labels("dead").inc()
            self.fail(exc)
            raise ServerError(f"engine failed: {exc}", status=503, reason="engine_failed") from None
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine bug must not look like a client error
            self.metrics.engine_failures.labels(type(exc).__name__).inc()
            log.error("engine error: %s", exc, exc_info=exc)
            raise ServerError(f"engine error: {type(exc).__name__}", status=500, reason="engine_error") from None
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

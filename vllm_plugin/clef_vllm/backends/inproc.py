"""vLLM's engine core in the server's own process, stepped by one thread (``--engine-core thread``).

Why: ``AsyncLLM`` always runs the engine core in a process of its own and talks to it over ZMQ. For one
short decision that trip costs ~2.5 ms (a 400-token FP8 decision took 18.1 ms with the engine core in
process and 20.7 ms with it apart), about what FP8 lacks to reach 20 ms through the
server. vLLM has no asyncio client for an in-process engine core, so this module drives its synchronous
``LLMEngine`` (engine core in process: ``InprocClient``) from a thread of its own and gives the backend
the part of ``AsyncLLM`` it uses: ``encode`` (an async generator of outputs), ``abort``, ``errored``,
``shutdown``, ``get_supported_tasks`` and the profiler switches.

Each request's input processing (vLLM's engine request from the prompt) runs in the caller's thread, as
AsyncLLM runs it in the server process, so that it can overlap a step's wait for the GPU; the engine
thread only registers the request with the output processor and the engine core between steps.

The price: the engine core's Python work (scheduling, input preparation, the pooler's host work) shares
one interpreter lock with the HTTP front end. It is released while the thread waits for the GPU, so at
c=1 nothing contends; under load the front end and the engine core slow each other. Measured on the
H200: one short decision 0.92x the default's time, 0.85-0.88x its req/s at
c=16/64; so off by default, one engine only (no data parallelism); docs/latency.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from clef_vllm.util import trace

log = logging.getLogger("clef_vllm")


class EngineThreadError(RuntimeError):
    """The engine thread stopped on an error; every request in flight and every later one gets it."""


class ThreadedEngine:
    """``AsyncLLM``'s surface (what :class:`~clef_vllm.backends.vllm_backend.VllmBackend` calls) over an engine
    whose ``add_request``, ``abort_request``, ``has_unfinished_requests`` and ``step`` run in one thread.

    ``make_engine()`` builds the engine in that thread, so that its CUDA work (model load, graph captures,
    every step) happens in one thread. Outputs reach each caller's ``asyncio.Queue`` on ``loop``."""

    def __init__(self, make_engine: Callable[[], Any], loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}        # request id -> its caller's queue
        self._error: BaseException | None = None
        self._lock = threading.Lock()          # orders a caller's send against the thread closing its inbox
        self._closed = False
        self._tasks = None                     # the engine's supported tasks, once asked (the backend asks at start)
        self.engine: Any = None
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(make_engine, ready), name="clef-engine-core",
                                        daemon=True)
        self._thread.start()
        ready.result()                                      # the engine's own error, if it could not start

    @classmethod
    def from_engine_args(cls, args, loop: asyncio.AbstractEventLoop, usage_context=None) -> "ThreadedEngine":
        """vLLM's ``LLMEngine`` for ``args`` with its engine core in this process."""
        def make():
            from vllm.v1.engine.llm_engine import LLMEngine

            # LLMEngine.from_engine_args turns multiprocessing on whenever this variable says so (its default)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            extra = {} if usage_context is None else {"usage_context": usage_context}
            return LLMEngine.from_engine_args(args, enable_multiprocessing=False, **extra)

        return cls(make, loop)

    # ------------------------------------------------------------------ AsyncLLM's surface

    @property
    def errored(self) -> bool:
        return self._error is not None or not self._thread.is_alive()

    async def get_supported_tasks(self):
        self._tasks = await self._call(lambda engine: engine.get_supported_tasks())
        return self._tasks

    async def start_profile(self) -> None:
        await self._call(lambda engine: engine.start_profile())

    async def stop_profile(self) -> None:
        await self._call(lambda engine: engine.stop_profile())

    async def encode(self, prompt, params, request_id: str):
        """The request's outputs as the engine produces them, the last one ``finished``. Cancelling the
        consumer aborts the request in the engine."""
        prepared = self._prepare(request_id, prompt, params)    # the request's own error, if vLLM refuses it
        outputs: asyncio.Queue = asyncio.Queue()
        self._send(("add", request_id, prompt, params, outputs, prepared))
        done = False
        try:
            while not done:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    done = True
                    raise out
                done = bool(out.finished)
                yield out
        finally:
            if not done:                                    # cancelled or closed early
                self._send(("abort", request_id), quiet=True)

    async def abort(self, request_id: str, internal: bool = False) -> None:
        self._send(("abort", request_id), quiet=True)

    def shutdown(self) -> None:
        self._send(("stop",), quiet=True)
        self._thread.join(timeout=30)
        engine = self.engine
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def _prepare(self, request_id: str, prompt, params):
        """vLLM's engine request for ``prompt``, built here in the caller's thread (as AsyncLLM builds it in
        the server process) rather than in the engine thread between steps: the same steps as
        ``LLMEngine.add_request`` up to the engine request (input processing, the internal request id). Only
        once the supported tasks are known (the backend asks at start), and only for an engine that has
        vLLM's input processor; ``None`` otherwise (the engine thread then adds the prompt itself)."""
        processor = getattr(self.engine, "input_processor", None)
        if processor is None or self._tasks is None:
            return None
        request = processor.process_inputs(request_id, prompt, params, supported_tasks=self._tasks)
        processor.assign_request_id(request)
        return request

    # ------------------------------------------------------------------ the engine thread

    async def _call(self, fn: Callable[[Any], Any]):
        """``fn(engine)`` in the engine thread, between steps."""
        done: Future = Future()
        self._send(("call", fn, done))
        return await asyncio.wrap_future(done)

    def _send(self, item: tuple, quiet: bool = False) -> None:
        """Hand ``item`` to the engine thread; once it stopped, raise (``quiet``: drop the item)."""
        with self._lock:
            if not self._closed:
                self._inbox.put(item)
                return
        if not quiet:
            raise EngineThreadError(f"the engine thread stopped: {self._error!r}")

    def _run(self, make_engine: Callable[[], Any], ready: Future) -> None:
        try:
            self.engine = make_engine()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of __init__
            self._error = exc
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            while self._drain(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            trace.event("received", out.request_id)
                        self._deliver(out.request_id, out, bool(out.finished))
        except BaseException as exc:  # noqa: BLE001 - every waiting caller gets it
            log.exception("clef engine thread stopped")
            self._error = exc
        self._close()

    def _close(self) -> None:
        """The thread is leaving: refuse new work, and fail what is in flight or still queued (after an
        error: with it; after shutdown: as stopped)."""
        with self._lock:
            self._closed = True
        error = EngineThreadError(f"the engine thread stopped: {self._error!r}")
        for request_id in list(self._queues):
            self._deliver(request_id, error, True)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                self._loop.call_soon_threadsafe(item[4].put_nowait, error)
            elif item[0] == "call":
                item[2].set_exception(error)

    def _drain(self, block: bool) -> bool:
        """Apply what the callers sent (adds, aborts, calls); with ``block`` (nothing to step), wait for
        the first item. ``False`` when told to stop."""
        while True:
            try:
                item = self._inbox.get() if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            kind = item[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, request_id, prompt, params, outputs, prepared = item
                self._queues[request_id] = outputs
                try:
                    if prepared is None:
                        self.engine.add_request(request_id, prompt, params)
                    else:    # the rest of LLMEngine.add_request for one request (vLLM 0.28), on the engine's state
                        self.engine.output_processor.add_request(prepared, None, None, 0)
                        self.engine.engine_core.add_request(prepared)
                except Exception as exc:  # noqa: BLE001 - this request's error, not the engine's
                    self._deliver(request_id, exc, True)
                else:
                    trace.event("sent", request_id)
            elif kind == "abort":
                if self._queues.pop(item[1], None) is not None:
                    self.engine.abort_request([item[1]])
            elif kind == "call":
                _, fn, done = item
                try:
                    done.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001
                    done.set_exception(exc)

    def _deliver(self, request_id: str, item: Any, last: bool) -> None:
        outputs = self._queues.pop(request_id, None) if last else self._queues.get(request_id)
        if outputs is not None:
            self._loop.call_soon_threadsafe(outputs.put_nowait, item)

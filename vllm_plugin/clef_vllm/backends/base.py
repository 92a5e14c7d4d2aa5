"""The backend interface the server and the offline API talk to (never to vLLM directly)."""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import logging
import os
import queue
import sys
import threading
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from clef_vllm.schema.encoding import EncodedRequest, RequestEncoder
from clef_vllm.schema.errors import Kind, ServiceError

log = logging.getLogger("clef_vllm")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"float32"`` (the head's compute dtype) -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


class BackendDeadError(ServiceError, RuntimeError):
    """The engine can no longer serve (its process died, its loop stopped): restart, do not retry."""

    default_kind = Kind.ENGINE_DEAD


@dataclass
class RequestStats:
    """What a batching backend measured for one request (filled by :class:`MicroBatcher`).

    The server puts one in :data:`REQUEST_STATS` before calling ``decide``; backends that do not
    batch leave it empty. Times are seconds and describe the whole micro-batch the request ran in.
    """

    batch_size: int = 0
    first_in_batch: bool = False     # exactly one request per batch carries it (count batches once)
    batch_wait_s: float = 0.0        # submitted -> its batch started
    run_s: float = 0.0               # the batch's decide_batch call
    stages: dict[str, float] = field(default_factory=dict)   # e.g. {"backbone": s}; see measure_stage


#: The current request's :class:`RequestStats` (``None`` outside the server).
REQUEST_STATS: contextvars.ContextVar[RequestStats | None] = contextvars.ContextVar("clef_request_stats",
                                                                                     default=None)
_stage_clock = threading.local()


@contextmanager
def measure_stage(name: str) -> Iterator[None]:
    """Add the time spent in the block to stage ``name`` of the batch running on this thread.

    A no-op outside a :class:`MicroBatcher` batch; backends wrap their backbone forward in it so the
    server can report backbone and head time separately."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times = getattr(_stage_clock, "times", None)
        if times is not None:
            times[name] = times.get(name, 0.0) + time.perf_counter() - t0


class Backend(ABC):
    """Runs the backbone and the joint head on encoded requests.

    ``decide_batch`` is the synchronous path (offline API); ``decide`` the asyncio path (server).
    Both return, per request, the fp32 per-option probabilities in encoded option order.
    Cancelling ``decide`` must drop the request from the engine when it has not run yet.
    """

    name: str = "backend"
    encoder: RequestEncoder
    max_model_len: int

    @abstractmethod
    def decide_batch(self, encoded: Sequence[EncodedRequest]) -> list[torch.Tensor]:
        """Probabilities for many requests at once (blocking)."""

    async def decide(self, encoded: EncodedRequest) -> torch.Tensor:
        """Probabilities for one request (non-blocking)."""
        return (await asyncio.to_thread(self.decide_batch, [encoded]))[0]

    async def start(self) -> None:  # noqa: B027 - optional hook: nothing to start by default
        """Called once inside the server's event loop before serving (engines, warm-up)."""

    def describe(self) -> dict:
        """What runs where, for startup logs and ``/v1/models``."""
        return {"backend": self.name}

    def media_limits(self, limits):
        """The server's media limits (``MediaLimits``) as this backend can serve them: as given by default."""
        return limits

    def event_loops(self) -> dict[str, asyncio.AbstractEventLoop]:
        """The event loops of the backend's own threads, by name (the server watches how late their timers run,
        as it does its own: :mod:`clef_vllm.server.loop_lag`). None by default."""
        return {}

    def check_health(self) -> None:  # noqa: B027 - optional hook: healthy by default
        """Raise :class:`BackendDeadError` if the engine can no longer serve (cheap; polled by the server)."""

    def suggested_max_in_flight(self) -> int:
        """How many requests the server should let into the engine at once.

        Default: two micro-batches for batching backends (``max_batch_size``), else 32."""
        batch = getattr(self, "max_batch_size", None)
        return 2 * int(batch) if batch else 32

    def close(self) -> None:  # noqa: B027 - optional hook: nothing to release by default
        """Release engines and threads."""


def lower_thread_priority(by: int) -> int | None:
    """Raise the calling thread's nice value by ``by`` (at most to 19): the scheduler then gives the process's other
    threads the cores first. Linux only, where niceness is per thread and a thread inherits its creator's: libgomp's
    OpenMP workers, which a thread starts at its first parallel torch op, run at its new value too. Returns that
    value; ``None`` when nothing changed (``by`` 0, another platform, or the call refused)."""
    if by <= 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError as exc:
        log.warning("could not lower the compute thread's priority: %s", exc)
        return None


def _libc_malloc_trim():
    """glibc's ``malloc_trim`` (``None`` elsewhere)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class MicroBatcher:
    """Collects concurrent ``decide`` calls into batches for a blocking ``decide_batch``.

    One worker thread owns the model; callers await futures. A batch is whatever is queued
    when the worker becomes free (up to ``max_batch_size`` requests / ``max_batch_tokens``).
    A caller that is cancelled before its batch starts is dropped from it (never computed).

    After a batch, at most once per ``trim_interval_s``, the worker hands free heap memory back to
    the OS (``malloc_trim``): on CPU, batches of ever-new shapes otherwise leave glibc's heap
    fragmented and the RSS grows without bound (measured on the tiny model: 1.0 -> 4.0 GB over 200
    batches; with a trim after each ~1.3 s batch it levels off at 0.97 GB, for ~60 ms per trim; no
    Python object or tensor was leaking). A batch that ran too soon after a trim for its own is trimmed
    after once the queue has stayed empty for ``trim_interval_s``, so an idle server holds no batch's
    free memory. ``None`` turns it off.

    ``nice``: the worker thread first lowers its own OS priority by that much (:func:`lower_thread_priority`;
    its OpenMP workers inherit it), so that on a CPU the event loop and the server's other threads, which wake
    for a few milliseconds at a time, are not queued behind forward passes that would keep every core busy.
    """

    def __init__(self, run_batch, max_batch_size: int = 32, max_batch_tokens: int = 65536,
                 trim_interval_s: float | None = 1.0, nice: int = 0):
        self._run = run_batch
        self._nice = nice
        self.nice: int | None = None  # the worker thread's nice value once it lowered it
        self._max_size = max_batch_size
        self._max_tokens = max_batch_tokens
        self._queue: queue.Queue = queue.Queue()
        self._trim = _libc_malloc_trim() if trim_interval_s is not None else None
        self._trim_interval_s = trim_interval_s
        self._trimmed_at = 0.0
        self._trim_owed = False       # a batch ran since the last trim: trim once the queue stays empty
        self.batches = 0              # batches run
        self.dropped = 0              # requests cancelled before their batch started
        self._thread = threading.Thread(target=self._loop, name="clef-reference-batcher", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(self, encoded: EncodedRequest) -> torch.Tensor:
        if not self.alive:
            raise BackendDeadError("the micro-batcher thread is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((encoded, fut, loop, REQUEST_STATS.get(), time.perf_counter()))
        return await fut

    def _next_batch(self) -> list | None:
        if self._trim_owed:                 # the last batch was not followed by a trim: trim once idle
            try:
                item = self._queue.get(timeout=self._trim_interval_s)
            except queue.Empty:
                self._trim(0)
                self._trimmed_at, self._trim_owed = time.perf_counter(), False
                item = self._queue.get()
        else:
            item = self._queue.get()
        if item is None:
            return None
        batch, tokens = [item], item[0].num_tokens
        while len(batch) < self._max_size:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)
                break
            if tokens + nxt[0].num_tokens > self._max_tokens:
                self._queue.put(nxt)  # next batch; order among queued requests is not promised
                break
            batch.append(nxt)
            tokens += nxt[0].num_tokens
        return batch

    def _loop(self) -> None:
        self.nice = lower_thread_priority(self._nice)     # before its first torch op starts its OpenMP workers
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            live = [b for b in batch if not b[1].cancelled()]
            self.dropped += len(batch) - len(live)
            if not live:
                continue
            started = time.perf_counter()
            _stage_clock.times = {}
            try:
                results = self._run([b[0] for b in live])
                error = None
            except BaseException as exc:  # noqa: BLE001 - hand every failure back to its caller
                log.exception("batch of %d requests failed", len(live))
                results, error = [None] * len(live), exc
            finally:
                stages, _stage_clock.times = _stage_clock.times, None
            self.batches += 1
            run_s = time.perf_counter() - started
            for k, (_, fut, loop, stats, submitted) in enumerate(live):
                if stats is not None:
                    stats.batch_size, stats.first_in_batch = len(live), k == 0
                    stats.batch_wait_s, stats.run_s, stats.stages = started - submitted, run_s, dict(stages)
                loop.call_soon_threadsafe(_resolve, fut, results[k], error)
            del results, live, batch
            if self._trim is not None and time.perf_counter() - self._trimmed_at >= self._trim_interval_s:
                self._trim(0)
                self._trimmed_at = time.perf_counter()
            self._trim_owed = self._trim is not None and self._trimmed_at < started

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        while True:  # anything still queued will never run: fail it instead of leaving callers waiting
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                try:
                    item[2].call_soon_threadsafe(_resolve, item[1], None, BackendDeadError("backend closed"))
                except RuntimeError:  # its event loop is already closed
                    pass


def _resolve(fut: asyncio.Future, result, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)

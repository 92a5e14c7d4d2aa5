"""The server's CPU pool: the bounded threads that decode, validate, encode and serialise requests off the event
loop, and the trimmer that hands freed heap memory back to the OS after large requests."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from clef_vllm.backends.base import _libc_malloc_trim
from clef_vllm.server.context import RequestContext
from clef_vllm.server.settings import DEFAULT_CPU_INLINE_BYTES

log = logging.getLogger("clef_vllm.server")

#: A request whose body had at least this many bytes is followed by a ``malloc_trim`` (at most one
#: per :data:`TRIM_INTERVAL_S`), so the memory its parsing used goes back to the OS.
TRIM_AFTER_BYTES = 1 << 20
TRIM_INTERVAL_S = 0.5


class CpuPool:
    """The bounded pool of threads that decodes, validates, encodes and serialises requests, so the
    event loop only moves bytes. Work is cancelled through its request's context: a job that has
    not started never runs; a running one stops at its next ``ctx.checkpoint()``. The work of a
    request whose body is at most ``inline_bytes`` (``--cpu-inline-bytes``) runs on the loop instead."""

    def __init__(self, workers: int, inline_bytes: int = DEFAULT_CPU_INLINE_BYTES):
        self.workers = max(1, int(workers))
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="clef-cpu")
        self.queued = 0
        self.inline_bytes = inline_bytes

    async def run(self, ctx: RequestContext | None, fn: Callable, *args, inline: bool = True) -> Any:
        """``fn(*args)`` in the pool (on the loop for a small body unless ``inline`` is False: media decoding,
        whose work does not follow the body's size)."""
        if inline and ctx is not None and 0 < ctx.body_bytes <= self.inline_bytes:
            ctx.checkpoint()
            return fn(*args)
        ctx_vars = contextvars.copy_context()            # log lines keep the request id
        call = functools.partial(ctx_vars.run, fn, *args)
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        except asyncio.CancelledError:
            if ctx is not None:
                ctx.cancelled.set()
            raise
        finally:
            self.queued -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Trimmer:
    """Hands freed heap memory back to the OS (glibc ``malloc_trim``) after large requests: at most
    once per ``interval`` seconds, and always once after the last large request."""

    def __init__(self, pool: CpuPool, interval: float = TRIM_INTERVAL_S):
        self._trim = _libc_malloc_trim()
        self._pool = pool
        self._interval = interval
        self._last = 0.0
        self._pending = False
        self.trims = 0

    def request(self) -> None:
        if self._trim is None or self._pending:
            return
        self._pending = True
        loop = asyncio.get_running_loop()
        loop.call_later(max(0.0, self._last + self._interval - time.monotonic()),
                        lambda: loop.create_task(self._run()))

    async def _run(self) -> None:
        try:
            await self._pool.run(None, self._trim, 0)
            self.trims += 1
        except Exception as exc:  # noqa: BLE001 - trimming is best effort
            log.debug("malloc_trim: %s", exc)
        finally:
            self._last = time.monotonic()
            self._pending = False


def default_cpu_workers() -> int:
    """Threads of the CPU pool: one per core, at most 8 (tokenization itself runs on all cores)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))

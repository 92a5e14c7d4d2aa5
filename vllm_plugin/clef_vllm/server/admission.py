"""Admission control: at most ``max_in_flight`` requests in the engine, a bounded wait queue.

Interactive requests (``POST /v1/systemone``) wait in a queue of at most ``max_queue``; when it
is full they are refused at once (HTTP 429 with ``Retry-After``). Bulk records wait without a
bound of their own (each bulk stream has its own concurrency bound). A freed slot goes to the
oldest interactive waiter, except that every ``BULK_EVERY``-th slot freed while both classes
wait goes to the oldest bulk waiter, so a saturating interactive load never starves a bulk job.
Slots are handed over first-in first-out within each class.

:class:`MemoryBudget` bounds the host memory that requests in progress hold (their decoded media): a request
waits, first-in first-out, until its bytes fit.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator

INTERACTIVE = "interactive"
BULK = "bulk"
#: While both classes wait, bulk records get one freed slot in this many.
BULK_EVERY = 4


class QueueFull(Exception):
    """No engine slot and no room in the interactive wait queue."""


class Admission:
    def __init__(self, max_in_flight: int, max_queue: int):
        if max_in_flight < 1 or max_queue < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queue >= 0")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.in_flight = 0
        self._waiting: dict[str, deque[asyncio.Future]] = {INTERACTIVE: deque(), BULK: deque()}
        self._service_s = 0.0         # moving average of how long a slot is held
        self._contended = 0           # slots handed over while both classes waited

    def waiting(self, kind: str = INTERACTIVE) -> int:
        return len(self._waiting[kind])

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and not any(self._waiting.values())

    async def acquire(self, kind: str = INTERACTIVE) -> None:
        """Take a slot, waiting if needed; raise :class:`QueueFull` (interactive only) when full."""
        if self.in_flight < self.max_in_flight and not any(self._waiting.values()):
            self.in_flight += 1
            return
        queue = self._waiting[kind]
        if kind == INTERACTIVE and len(queue) >= self.max_queue:
            raise QueueFull()
        fut = asyncio.get_running_loop().create_future()
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()            # the slot arrived just as we were cancelled: pass it on
            else:
                try:
                    queue.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self, held_s: float | None = None) -> None:
        """Give a slot back: to the oldest interactive waiter (every ``BULK_EVERY``-th contended slot:
        the oldest bulk waiter), else to the pool."""
        if held_s is not None:
            self._service_s = held_s if self._service_s == 0 else 0.9 * self._service_s + 0.1 * held_s
        order = (INTERACTIVE, BULK)
        if self._waiting[INTERACTIVE] and self._waiting[BULK]:
            self._contended += 1
            if self._contended % BULK_EVERY == 0:
                order = (BULK, INTERACTIVE)
        for kind in order:
            queue = self._waiting[kind]
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)
                    return
        self.in_flight -= 1

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the time to drain the queue ahead of it (1..60)."""
        waves = (self.waiting(INTERACTIVE) + self.in_flight) / self.max_in_flight
        return int(min(60, max(1, math.ceil(waves * self._service_s))))


class MemoryBudget:
    """At most ``capacity`` bytes held by requests in progress. A request whose bytes do not fit waits,
    first-in first-out (a large one is not overtaken by smaller ones behind it), until enough are given back;
    one that needs more than ``capacity`` runs alone. ``capacity`` None: no bound."""

    def __init__(self, capacity: int | None):
        if capacity is not None and capacity < 1:
            raise ValueError("capacity must be >= 1 byte, or None")
        self.capacity = capacity
        self.held = 0
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _fits(self, n: int) -> bool:
        return self.capacity is None or self.held == 0 or self.held + n <= self.capacity

    @asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        """Hold ``n`` bytes for the block, waiting for them first (cancellable while it waits)."""
        await self._acquire(n)
        try:
            yield
        finally:
            self._release(n)

    async def _acquire(self, n: int) -> None:
        if not self._waiting and self._fits(n):
            self.held += n
            return
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self._release(n)          # the bytes arrived just as we were cancelled: pass them on
            else:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                self._wake()              # the head may have left: the next ones may fit now
            raise

    def _release(self, n: int) -> None:
        self.held -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            n, fut = self._waiting.popleft()
            if not fut.done():
                self.held += n
                fut.set_result(None)

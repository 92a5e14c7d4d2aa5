"""Clocks that tests own, so timing logic is tested by what it does, never by how long it took.

* :class:`VirtualClock`: patches ``time.perf_counter`` / ``time.monotonic`` / ``time.time`` and runs coroutines on a loop
  whose timers never sleep; ``advance(s)`` inside a coroutine is the loop held for ``s`` (a blocking call).

      clock = VirtualClock(monkeypatch)
      result = clock.run(scenario())


* :class:`VirtualClockLoop`: the clock moves only when the loop would wait for a timer, and then straight to
  that timer: ``await asyncio.sleep(5)`` returns at once with ``loop.time()`` exactly 5 s later. Everything
  runs in the order real time would give it, at no cost in wall time.
* :class:`ManualClockLoop`: the clock moves only when told (:meth:`ManualClockLoop.advance`, from the loop's
  own thread or through ``call_soon_threadsafe``); a timer that is not due yet waits, without spinning, until
  then. For a loop in another thread that the test steps one period at a time.

In the last two, ``advance(s)`` called from a callback is a callback that held the loop for ``s`` seconds.
"""

from __future__ import annotations

import asyncio
import selectors
import time

#: what ``time.time()`` reads at virtual time 0 (2025-12-03)
START_UNIX = 1_764_800_000.0


class VirtualClock:
    def __init__(self, monkeypatch=None, start_unix: float = START_UNIX):
        self.now = 0.0
        self.start_unix = start_unix
        if monkeypatch is not None:
            monkeypatch.setattr(time, "perf_counter", lambda: self.now)
            monkeypatch.setattr(time, "monotonic", lambda: self.now)
            monkeypatch.setattr(time, "time", lambda: self.start_unix + self.now)

    def advance(self, seconds: float) -> None:
        """``seconds`` pass without the loop running (what a synchronous call that holds the loop does)."""
        self.now += seconds

    def new_loop(self) -> asyncio.AbstractEventLoop:
        """An event loop on this clock: where it would sleep until its next timer, the clock jumps there."""
        clock = self

        class Selector(selectors.DefaultSelector):
            def select(self, timeout=None):
                if timeout is None:                       # nothing scheduled: real I/O only
                    return super().select(None)
                ready = super().select(0)
                if not ready:
                    clock.now += timeout
                return ready

        loop = asyncio.SelectorEventLoop(Selector())
        loop.time = lambda: clock.now
        return loop

    def run(self, coro):
        """``asyncio.run(coro)`` on a loop of this clock."""
        with asyncio.Runner(loop_factory=self.new_loop) as runner:
            return runner.run(coro)


#: A timer this close (s) to the clock is due: periods added up in floating point land a few ulps off.
DUE_WITHIN = 1e-9


class ManualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is a number the test moves with :meth:`advance`."""

    def __init__(self) -> None:
        super().__init__(selectors.DefaultSelector())
        self.now = 0.0
        self._real_select = self._selector.select
        self._selector.select = self._select

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward (as a callback: one that held the loop that long)."""
        self.now += seconds

    def _select(self, timeout: float | None = None):
        if timeout is not None and timeout <= DUE_WITHIN:     # due, but for the rounding of a sum of periods
            return self._real_select(0)
        # a timer not due on this clock: wait for I/O or another thread's call, however long that takes
        return self._real_select(None)


class VirtualClockLoop(ManualClockLoop):
    """A :class:`ManualClockLoop` that advances itself to the next timer whenever nothing else is ready."""

    def _select(self, timeout: float | None = None):
        if not timeout:
            return self._real_select(timeout)
        events = self._real_select(0)
        if not events:
            self.now += timeout
        return events


def run_virtual(coro):
    """``asyncio.run(coro)`` on a :class:`VirtualClockLoop`."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(coro)

"""A virtual clock for asyncio tests: time passes only where the event loop would wait, so a test that measures
durations reads exact values instead of the machine's wall clock (which a loaded CI machine stretches).

    clock = VirtualClock(monkeypatch)          # time.perf_counter / time.monotonic / time.time follow it
    result = clock.run(scenario())             # asyncio.run on a loop whose timers never sleep
    clock.advance(0.25)                        # inside a coroutine: the loop held for 0.25 s (a blocking call)

Only for coroutines that wait on timers (``asyncio.sleep``, timeouts): a loop waiting on real I/O with nothing
scheduled blocks as usual.
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

"""The event-loop watchers (clef_vllm.server.loop_lag): every lateness observed, a stall logged; the server
watches its own loop and the backend's. The loops run on clocks the tests own (tests/support/virtual_clock.py):
a held loop is a callback that moves the clock, so every lateness is exact."""

import asyncio
import logging
import threading

import pytest

from clef_vllm.backends.base import Backend
from clef_vllm.schema.protocol import RequestLimits
from clef_vllm.server.loop_lag import INTERVAL_S, watch_loop_lag
from clef_vllm.server.metrics import ServerMetrics
from clef_vllm.server.service import READY, DecisionService
from clef_vllm.server.settings import ServerSettings
from support.virtual_clock import ManualClockLoop, run_virtual


def stall_lines(caplog, name):
    return [r for r in caplog.records if r.getMessage().startswith(f"event loop ({name}): a timer ran")]


def test_a_held_loop_is_observed_and_logged_and_the_watcher_stops_when_told(caplog):
    """On a virtual clock: timers every 10 ms, the loop held 300 ms by a synchronous call 5 ms before one was
    due; exactly that timer is late, by 295 ms, and only it is logged."""
    caplog.set_level(logging.INFO, logger="clef_vllm")
    lags, running = [], [True]

    async def main():
        loop = asyncio.get_running_loop()
        watcher = loop.create_task(watch_loop_lag(lags.append, lambda: running[0], "http", interval_s=0.01,
                                                  stall_s=0.15))
        await asyncio.sleep(0.105)
        loop.advance(0.3)                     # a synchronous call holds the loop for 300 ms
        await asyncio.sleep(0.1025)
        running[0] = False
        await asyncio.wait_for(watcher, 1.0)  # it ends on its own once told

    run_virtual(main())
    stalls = stall_lines(caplog, "http")
    assert len(stalls) == 1 and stalls[0].levelno == logging.WARNING
    assert "no request was read and no answer sent meanwhile" in stalls[0].getMessage()
    assert int(stalls[0].getMessage().split(" ran ")[1].split(" ms")[0]) == 295   # due at 110 ms, ran at 405 ms
    # 10 timers before the hold, the late one, 10 after it, and the one that saw it was told to stop
    assert len(lags) == 22 and min(lags) >= 0.0
    assert [i for i, lag in enumerate(lags) if lag > 1e-9] == [10] and lags[10] == pytest.approx(0.295)


class LoopBackend(Backend):
    """A backend with an event loop of its own in a thread (as the vLLM backend's engine thread), on a clock
    the test moves."""

    name = "loops"

    def __init__(self):
        self.engine_loop = ManualClockLoop()
        self.thread = threading.Thread(target=self.engine_loop.run_forever, daemon=True)
        self.thread.start()

    def event_loops(self):
        return {"engine": self.engine_loop}

    def decide_batch(self, encoded):
        raise NotImplementedError

    def close(self):
        self.engine_loop.call_soon_threadsafe(self.engine_loop.stop)
        self.thread.join(5)


async def _settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_the_server_watches_its_loop_and_the_backends_and_cancels_the_backends_watcher_first(caplog):
    """Both loops on clocks the test moves one watcher period at a time (``INTERVAL_S``): each period is one
    observation on each loop; the engine thread's loop held for 250 ms is one logged stall, on it alone; at
    close the engine's watcher ends at its next wake-up, on its own, before the backend stops its loop."""
    caplog.set_level(logging.INFO, logger="clef_vllm")
    metrics = ServerMetrics()
    service = DecisionService(ServerSettings(), metrics)
    backend = LoopBackend()
    engine = backend.engine_loop

    async def on_engine(step, *args):
        """Run ``step(*args)`` as a callback on the engine's loop and let what it made due run there."""
        async def call():
            step(*args)
            await _settle()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), engine))

    async def main():
        http = asyncio.get_running_loop()
        service.loop = http
        service.status = READY
        service._watch_loops(backend)
        await _settle()
        await on_engine(lambda: None)                     # the engine's watcher has started
        for _ in range(5):                                # five periods on time, on both loops
            http.advance(INTERVAL_S)
            await _settle()
            await on_engine(engine.advance, INTERVAL_S)
        await on_engine(engine.advance, 0.25)             # the engine thread's loop is held for 250 ms
        watcher = service._loop_watchers[0]
        closing = http.create_task(service.close())       # cancels the watchers, then closes the backend
        await _settle()
        assert not watcher.done()                         # the engine's watcher sleeps until its next wake-up
        engine.call_soon_threadsafe(engine.advance, INTERVAL_S)   # (close stops the engine's loop after it)
        await closing
        assert watcher.done() and not watcher.cancelled()     # it ended on its own

    service.backend = backend
    with asyncio.Runner(loop_factory=ManualClockLoop) as runner:
        runner.run(main())
    counts = {loop: metrics.registry.get_sample_value("clef_event_loop_lag_seconds_count", {"loop": loop})
              for loop in ("http", "engine")}
    assert counts == {"http": 5, "engine": 7}        # engine: 5 periods, the late wake-up, the last one
    assert len(stall_lines(caplog, "engine")) == 1 and stall_lines(caplog, "http") == []
    stall = stall_lines(caplog, "engine")[0].getMessage()
    assert "no request reached the engine" in stall and " ran 200 ms late" in stall


def test_a_metrics_scrape_does_not_count_the_frozen_objects_again(monkeypatch):
    """``gc.get_freeze_count()`` walks every frozen object (~40 ms of the event loop for a server's ~400,000 on two
    cores): the server counts them when it freezes them, and /metrics reads that count."""
    import gc

    from prometheus_client import generate_latest

    import clef_vllm.server.service as service_module

    monkeypatch.setattr(service_module, "freeze_heap", lambda: (123_456, 1.0))
    metrics = ServerMetrics()
    service = DecisionService(ServerSettings(freeze_heap=True), metrics)
    counted = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: counted.append(1) or 0)

    class Quick(Backend):
        name = "quick"
        encoder = type("E", (), {"request_limits": lambda self: RequestLimits()})()

        def decide_batch(self, encoded):
            raise NotImplementedError

    async def main():
        task = asyncio.get_running_loop().create_task(service.run(Quick))
        while service.status != READY:
            assert not task.done(), task.exception()          # a start-up that failed would leave this waiting
            await asyncio.sleep(0.01)
        for _ in range(3):
            generate_latest(metrics.registry)
        await service.close()
        task.cancel()

    asyncio.run(main())
    assert metrics.registry.get_sample_value("clef_gc_frozen_objects") == 123_456 and counted == []

"""The event-loop watchers (clef_vllm.server.loop_lag): every lateness observed, a stall logged; the server
watches its own loop and the backend's."""

import asyncio
import logging
import threading
import time

from clef_vllm.backends.base import Backend
from clef_vllm.server.loop_lag import watch_loop_lag
from clef_vllm.server.metrics import ServerMetrics
from clef_vllm.server.service import READY, DecisionService
from clef_vllm.server.settings import ServerSettings


def stall_lines(caplog, name):
    return [r for r in caplog.records if r.getMessage().startswith(f"event loop ({name}): a timer ran")]


def test_a_held_loop_is_observed_and_logged_and_the_watcher_stops_when_told(caplog):
    caplog.set_level(logging.INFO, logger="clef_vllm")
    lags, running = [], [True]

    async def main():
        watcher = asyncio.get_running_loop().create_task(
            watch_loop_lag(lags.append, lambda: running[0], "http", interval_s=0.01, stall_s=0.15))
        await asyncio.sleep(0.1)
        time.sleep(0.3)                      # a synchronous call holds the loop
        await asyncio.sleep(0.1)
        running[0] = False
        await asyncio.wait_for(watcher, 1.0)  # it ends on its own once told

    asyncio.run(main())
    stalls = stall_lines(caplog, "http")
    assert len(stalls) == 1 and stalls[0].levelno == logging.WARNING
    assert "no request was read and no answer sent meanwhile" in stalls[0].getMessage()
    late = int(stalls[0].getMessage().split(" ran ")[1].split(" ms")[0])
    assert 200 <= late <= 400
    assert len(lags) >= 10 and max(lags) >= 0.2 and min(lags) >= 0.0
    assert sorted(lags)[len(lags) // 2] < 0.15  # a free loop's timers run about on time


class LoopBackend(Backend):
    """A backend with an event loop of its own in a thread (as the vLLM backend's engine thread)."""

    name = "loops"

    def __init__(self):
        self.engine_loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.engine_loop.run_forever, daemon=True)
        self.thread.start()

    def event_loops(self):
        return {"engine": self.engine_loop}

    def decide_batch(self, encoded):
        raise NotImplementedError

    def close(self):
        self.engine_loop.call_soon_threadsafe(self.engine_loop.stop)
        self.thread.join(5)


def test_the_server_watches_its_loop_and_the_backends_and_cancels_the_backends_watcher_first(caplog):
    caplog.set_level(logging.INFO, logger="clef_vllm")
    metrics = ServerMetrics()
    service = DecisionService(ServerSettings(), metrics)
    backend = LoopBackend()

    async def main():
        service.loop = asyncio.get_running_loop()
        service.status = READY
        service._watch_loops(backend)
        await asyncio.sleep(0.3)
        backend.engine_loop.call_soon_threadsafe(time.sleep, 0.25)   # the engine thread's loop is held
        await asyncio.sleep(0.5)
        watcher = service._loop_watchers[0]
        await service.close()                 # cancels the watchers, then closes the backend
        assert watcher.done() and not watcher.cancelled()     # it ended on its own

    service.backend = backend
    asyncio.run(main())
    counts = {loop: metrics.registry.get_sample_value("clef_event_loop_lag_seconds_count", {"loop": loop})
              for loop in ("http", "engine")}
    assert counts["http"] >= 5 and counts["engine"] >= 5
    assert len(stall_lines(caplog, "engine")) == 1 and stall_lines(caplog, "http") == []
    assert "no request reached the engine" in stall_lines(caplog, "engine")[0].getMessage()


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
        encoder = type("E", (), {"request_limits": lambda self: None})()

        def decide_batch(self, encoded):
            raise NotImplementedError

    async def main():
        task = asyncio.get_running_loop().create_task(service.run(Quick))
        while service.status != READY:
            await asyncio.sleep(0.01)
        for _ in range(3):
            generate_latest(metrics.registry)
        await service.close()
        task.cancel()

    asyncio.run(main())
    assert metrics.registry.get_sample_value("clef_gc_frozen_objects") == 123_456 and counted == []

"""How late the server's event loop runs its timers: a stalled loop reads no request and sends no answer.

A closed loop of clients at c=64 runs as two cohorts a cycle (41 + 23 short decisions on a 9B); a cohort
whose requests the front end reads late misses the step it would have joined, and the cycle reshapes for a
while (full garbage collections held cohorts ~300 ms before start-up's objects were frozen: docs/latency.md,
"Garbage collection stopped the front end"). Whatever holds the loop (a full garbage collection, a slow
synchronous call), :func:`watch_loop_lag` sees it as a timer that fires late:
every :data:`INTERVAL_S` it sleeps and measures how much later than asked it woke, hands each lag to
``observe`` (the server's ``clef_event_loop_lag_seconds``) and logs each stall of :data:`STALL_S` or more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("clef_vllm")

#: The watcher wakes this often (s): 20 timers a second, a few microseconds each.
INTERVAL_S = 0.05
#: A timer this late (s) or later is a stall, logged as a WARNING.
STALL_S = 0.1
#: How a stall's log line starts (then the loop's name): a log reader finds these lines by it.
STALL_LINE = "event loop ("
#: What a held loop stops, by its name.
HELD = {"http": "no request was read and no answer sent meanwhile",
        "engine": "no request reached the engine and no engine output was handed on meanwhile"}
#: ``clef_event_loop_lag_seconds``' buckets (s): fine from 10 to 100 ms, so that a p99 near the 50 ms target
#: (docs/operating.md, "Soak") is read off bucket bounds 5-25 ms apart rather than guessed inside 50-100 ms.
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


async def watch_loop_lag(observe: Callable[[float], None], running: Callable[[], bool], name: str = "http",
                         interval_s: float = INTERVAL_S, stall_s: float = STALL_S) -> None:
    """On the running loop (``name`` in the log: ``http``, the server's; ``engine``, the vLLM backend's engine
    thread's), until ``running()`` turns false: sleep ``interval_s``, hand the lateness of the wake-up to
    ``observe`` and log it when it is ``stall_s`` or more."""
    loop = asyncio.get_running_loop()
    while running():
        asked = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        lag = max(loop.time() - asked, 0.0)
        observe(lag)
        if lag >= stall_s:
            log.warning(STALL_LINE + "%s): a timer ran %.0f ms late (%s; a full garbage collection in that time "
                        "says so on its own line)", name, lag * 1000.0, HELD.get(name, "held"))

"""The server's event-loop watcher (clef_vllm.server.loop_lag): every lateness observed, a stall logged."""

import asyncio
import logging
import time

from clef_vllm.server.loop_lag import watch_loop_lag


def test_a_held_loop_is_observed_and_logged_and_the_watcher_stops_when_told(caplog):
    caplog.set_level(logging.INFO, logger="clef_vllm")
    lags, running = [], [True]

    async def main():
        watcher = asyncio.get_running_loop().create_task(
            watch_loop_lag(lags.append, lambda: running[0], interval_s=0.01, stall_s=0.15))
        await asyncio.sleep(0.1)
        time.sleep(0.3)                      # a synchronous call holds the loop
        await asyncio.sleep(0.1)
        running[0] = False
        await asyncio.wait_for(watcher, 1.0)  # it ends on its own once told

    asyncio.run(main())
    stalls = [r for r in caplog.records if r.getMessage().startswith("event loop: a timer ran")]
    assert len(stalls) == 1 and stalls[0].levelno == logging.WARNING
    late = int(stalls[0].getMessage().split(" ran ")[1].split(" ms")[0])
    assert 200 <= late <= 400
    assert len(lags) >= 10 and max(lags) >= 0.2 and min(lags) >= 0.0
    assert sorted(lags)[len(lags) // 2] < 0.15  # a free loop's timers run about on time

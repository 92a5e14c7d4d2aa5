"""A quiet end for vLLM's ``AsyncLLM``.

vLLM 0.28's ``AsyncLLM.shutdown`` stops the engine core first and cancels its output handler after, so the
handler, waiting on the core's output socket, wakes to ``EngineDeadError`` and logs it with a traceback
("AsyncLLM output_handler failed") on every clean exit of an offline ``Clef`` or a server. Cancelled on its own
event loop before the shutdown, the handler ends without a word; vLLM's later cancel finds it done.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


async def stop_output_handler(engine) -> None:
    """Cancel ``engine``'s output handler, if it runs, and wait for it to end (on the engine's event loop)."""
    handler = getattr(engine, "output_handler", None)
    if handler is not None and not handler.done():
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)


def shutdown_engine(engine, loop: asyncio.AbstractEventLoop) -> None:
    """``engine.shutdown()``, its output handler stopped first on ``loop`` (the engine's) while that loop runs.
    What fails is logged, never raised: a closing backend always gets to its engine's shutdown."""
    if loop.is_running():
        try:
            asyncio.run_coroutine_threadsafe(stop_output_handler(engine), loop).result(timeout=10)
        except Exception as exc:  # noqa: BLE001
            log.warning("engine shutdown: stopping the output handler: %s", exc)
    try:
        engine.shutdown()
    except Exception as exc:  # noqa: BLE001
        log.warning("engine shutdown: %s", exc)

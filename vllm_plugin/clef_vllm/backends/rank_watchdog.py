"""Liveness of the data-parallel ranks on other nodes (docs/deploy.md, "A remote engine that dies").

vLLM 0.28's head watches only its own node's engine processes (``core_client.py``
``start_engine_core_monitor``): a rank on a ``--headless`` node that vanishes without a word (SIGKILL, a lost
host, its node stopped) leaves the head waiting on it. :class:`RankWatchdog` asks each such rank, every
``interval_s``, for something cheap through vLLM's own client: a utility call addressed to that one engine
(``AsyncMPClient._call_utility_async(..., engine=identity)``, the call vLLM's ``DPLBAsyncMPClient`` fans out
to every rank). A rank that leaves :data:`MISSES` probes in a row unanswered past their deadline is declared
dead and ``on_dead`` is called once, with the rank and why.

The engine core answers a utility call from its busy loop between two steps (``core.py`` ``run_busy_loop``:
``_process_input_queue`` then ``_process_engine_step``), so a rank in the middle of a long step answers late,
not never: probes sent during one step of ``B`` seconds miss about ``B / deadline_s`` times, and a rank is
declared dead only once it has been silent for ``MISSES x deadline_s`` (30 s by default), far beyond a step
(seconds at most: a prompt is chunked into steps of ``max_num_batched_tokens`` tokens).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

log = logging.getLogger("clef_vllm")

#: The engine core's utility method each probe calls: two attribute reads in the engine process
#: (``EngineCore.is_sleeping``), nothing on the GPU.
PROBE_METHOD = "is_sleeping"
#: Seconds between two probes of one rank (``--rank-watchdog-s``'s default; 0 turns the watchdog off).
DEFAULT_INTERVAL_S = 5.0
#: A probe's deadline, in probe intervals.
DEADLINE_INTERVALS = 2.0
#: Probes in a row a rank leaves unanswered before it is declared dead.
MISSES = 3


def engine_identity(rank: int) -> bytes:
    """The ZMQ identity vLLM's client addresses data-parallel rank ``rank`` by (``core_client.py``:
    ``rank.to_bytes(2, "little")``)."""
    return rank.to_bytes(2, "little")


def silence_limit_s(interval_s: float) -> float:
    """How long a rank may leave every probe unanswered before it is declared dead."""
    return MISSES * DEADLINE_INTERVALS * interval_s


class RankWatchdog:
    """Probe each of ``ranks`` through ``client`` (vLLM's engine-core client, ``AsyncLLM.engine_core``) every
    ``interval_s`` on the running event loop; call ``on_dead(rank, reason)`` once for the first rank that
    misses :data:`MISSES` deadlines (``deadline_s``, default :data:`DEADLINE_INTERVALS` x ``interval_s``) in a
    row, then stop probing."""

    def __init__(self, client: Any, ranks: Sequence[int], on_dead: Callable[[int, str], None], interval_s: float,
                 deadline_s: float | None = None, misses: int = MISSES):
        self.client = client
        self.ranks = list(ranks)
        self.on_dead = on_dead
        self.interval_s = interval_s
        self.deadline_s = deadline_s if deadline_s is not None else DEADLINE_INTERVALS * interval_s
        self.misses = misses
        self.dead: tuple[int, str] | None = None
        self.stopped = False
        self._tasks: list[asyncio.Task] = []

    @classmethod
    def supported(cls, client: Any) -> bool:
        """Whether ``client`` can address a utility call to one engine (vLLM's multi-process clients can)."""
        return callable(getattr(client, "_call_utility_async", None)) and hasattr(client, "core_engines")

    def start(self) -> None:
        """Start one probing task per rank on the running loop."""
        known = set(getattr(self.client, "core_engines", ()))
        loop = asyncio.get_running_loop()
        for rank in self.ranks:
            if engine_identity(rank) not in known:
                log.warning("rank watchdog: vLLM's client holds no engine for data-parallel rank %d; not watched", rank)
                continue
            self._tasks.append(loop.create_task(self._watch(rank), name=f"clef-rank-watchdog-{rank}"))
        if self._tasks:
            log.info("rank watchdog: probing data-parallel ranks %s every %g s (deadline %g s; dead after %d misses "
                     "in a row)", self.ranks, self.interval_s, self.deadline_s, self.misses)

    def stop(self) -> None:
        """Stop probing (call on the loop the watchdog runs on); no verdict is given after this."""
        self.stopped = True
        for task in self._tasks:
            task.cancel()

    async def probe(self, rank: int) -> Any:
        """One utility call addressed to ``rank``'s engine alone."""
        return await self.client._call_utility_async(PROBE_METHOD, engine=engine_identity(rank))

    async def _watch(self, rank: int) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        loop = asyncio.get_running_loop()
        missed = 0
        while not self.stopped and self.dead is None:
            t0 = loop.time()
            try:
                await asyncio.wait_for(self.probe(rank), self.deadline_s)
                missed = 0
            except asyncio.TimeoutError:
                if self.stopped:
                    return
                missed += 1
                log.warning("rank watchdog: data-parallel rank %d did not answer within %g s (%d of %d)", rank,
                            self.deadline_s, missed, self.misses)
            except EngineDeadError:
                return              # the client itself is dead: the backend's health check says so
            except Exception as exc:  # noqa: BLE001 - a probe that cannot be sent or answered counts as a miss
                if self.stopped:
                    return
                missed += 1
                log.warning("rank watchdog: probe of data-parallel rank %d failed (%d of %d): %s", rank, missed,
                            self.misses, exc)
            if missed >= self.misses:
                self._declare(rank, missed)
                return
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - t0)))

    def _declare(self, rank: int, missed: int) -> None:
        if self.stopped or self.dead is not None:
            return
        reason = (f"data-parallel rank {rank} (on another node) answered none of {missed} liveness probes in a row "
                  f"(deadline {self.deadline_s:g} s each): its engine is gone")
        self.dead = (rank, reason)
        log.error("rank watchdog: %s", reason)
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.on_dead(rank, reason)

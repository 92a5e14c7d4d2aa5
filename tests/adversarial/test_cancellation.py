"""A request that no longer needs its CPU work (deadline passed, client gone, shutdown) stops it:
in-process checks of the CPU pool, the encoder's checkpoints and the value scan (no server)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from clef_vllm.server.context import RequestContext, WorkCancelled
from clef_vllm.server.cpu_pool import CpuPool


def test_cancelled_pool_work_stops_at_its_next_checkpoint_and_queued_work_never_runs():
    pool = CpuPool(1)
    steps, started_second = [], threading.Event()

    def busy(ctx: RequestContext):
        while True:
            ctx.checkpoint()
            steps.append(1)
            time.sleep(0.001)

    def second():
        started_second.set()

    async def run():
        ctx, other = RequestContext("a", "test"), RequestContext("b", "test")
        work = asyncio.ensure_future(pool.run(ctx, busy, ctx))
        queued = asyncio.ensure_future(pool.run(other, second))
        await asyncio.sleep(0.2)
        work.cancel()
        queued.cancel()
        await asyncio.gather(work, queued, return_exceptions=True)
        assert ctx.cancelled.is_set()
        n = len(steps)
        await asyncio.sleep(0.2)
        return n

    n = asyncio.run(run())
    assert n > 0 and len(steps) <= n + 2             # it stopped within a step of the cancellation
    assert not started_second.is_set()               # never started
    pool.close()


def test_encoding_and_the_value_scan_stop_when_cancelled(tiny_release):
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.protocol import RequestLimits
    from clef_vllm.server.body import count_values

    encoder = RequestEncoder.from_pretrained(tiny_release, max_length=16384)
    request = parse_request({"model": "m", "state": "many words " * 200_000, "questions": {
        f"q{i}": {"type": "noul", "instructions": "Is it? " * 20} for i in range(40)}})
    ctx = RequestContext("c", "test")
    calls = []

    def checkpoint():
        calls.append(1)
        if len(calls) > 1:
            ctx.cancelled.set()
        ctx.checkpoint()

    with pytest.raises(WorkCancelled):
        encoder.encode(request, checkpoint=checkpoint)
    assert len(calls) == 2
    ctx2 = RequestContext("d", "test")
    ctx2.cancelled.set()
    body = b'{"state":[' + b'"a,b",' * 400_000 + b'1]}'
    with pytest.raises(WorkCancelled):
        count_values(body, RequestLimits.for_tokens(16384).max_values, ctx2.checkpoint)


def test_a_small_requests_cpu_work_runs_on_the_loop_and_a_large_ones_in_the_pool():
    """A thread hop costs more than a small body's own work, so it is done on the event loop; a large
    body's is not (it would hold the loop); a cancelled request's work does not start either way."""
    from clef_vllm.server.settings import DEFAULT_CPU_INLINE_BYTES

    pool = CpuPool(2)

    async def run():
        loop_thread = threading.get_ident()
        small, large, gone = (RequestContext(n, "test") for n in ("s", "l", "g"))
        small.body_bytes, large.body_bytes, gone.body_bytes = DEFAULT_CPU_INLINE_BYTES, DEFAULT_CPU_INLINE_BYTES + 1, 10
        gone.cancelled.set()
        ran = []
        on_loop = await pool.run(small, lambda: threading.get_ident() == loop_thread)
        in_pool = await pool.run(large, lambda: threading.get_ident() != loop_thread)
        with pytest.raises(WorkCancelled):
            await pool.run(gone, ran.append, 1)
        return on_loop, in_pool, ran

    on_loop, in_pool, ran = asyncio.run(run())
    assert on_loop and in_pool and ran == []
    pool.close()


def test_a_body_already_received_is_taken_even_when_the_server_was_busy_past_the_deadline():
    """A client that has sent its whole body is never refused as too slow, however long the server spends
    between two pieces (a bulk stream working through a piece's lines): the deadlines count only the time
    spent waiting for bytes, and bytes already received are taken even past a deadline."""
    from clef_vllm.schema.errors import Kind, RequestError
    from clef_vllm.server.body import BodyReader

    async def run(stall_after: int | None):
        queue: asyncio.Queue = asyncio.Queue()
        pieces = [{"type": "http.request", "body": b"x" * 10, "more_body": True} for _ in range(3)]
        pieces.append({"type": "http.request", "body": b"", "more_body": False})
        for i, piece in enumerate(pieces):
            if stall_after is None or i < stall_after:
                queue.put_nowait(piece)                  # all of it is here at once (a client that sent it all)
        reader = BodyReader(queue.get, body_timeout=0.2, min_rate=1000.0)
        got = 0
        while not reader.done:
            got += len((await reader.message())["body"])
            time.sleep(0.3)                              # the server is busy elsewhere: longer than the timeout
        return got

    assert asyncio.run(run(None)) == 30
    with pytest.raises(RequestError) as err:             # a client that really stops sending still gets 408
        asyncio.run(run(2))
    assert err.value.kind is Kind.SLOW_CLIENT and "--body-timeout" in str(err.value)

"""A request that no longer needs its CPU work (deadline passed, client gone, shutdown) stops it:
in-process checks of the CPU pool, the encoder's checkpoints and the value scan (no server)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from clef_vllm.server.context import RequestContext, WorkCancelled
from clef_vllm.server.service import CpuPool


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
    from clef_vllm.encoding import RequestEncoder
    from clef_vllm.protocol import RequestLimits, parse_request
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

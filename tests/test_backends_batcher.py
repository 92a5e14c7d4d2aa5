"""The backends' micro-batcher (clef_vllm/backends/base.py ``MicroBatcher``): cancelled requests dropped
before their batch runs, the batch statistics each request reports, and the idle trim of a batch's memory."""

from __future__ import annotations

import asyncio
import threading


async def _settle(n: int = 5):
    for _ in range(n):
        await asyncio.sleep(0)


def test_micro_batcher_drops_cancelled_requests_and_reports_batch_stats():
    from types import SimpleNamespace

    import torch

    from clef_vllm.backends.base import REQUEST_STATS, MicroBatcher, RequestStats, measure_stage

    gate, seen = threading.Event(), []

    def run(batch):
        seen.append([e.num_tokens for e in batch])
        if len(seen) == 1:
            gate.wait(60)
        with measure_stage("backbone"):
            pass
        return [torch.full((1,), float(e.num_tokens)) for e in batch]

    batcher = MicroBatcher(run, max_batch_size=8)

    def submit(n):
        stats = RequestStats()
        token = REQUEST_STATS.set(stats)
        try:
            return asyncio.ensure_future(batcher.submit(SimpleNamespace(num_tokens=n))), stats
        finally:
            REQUEST_STATS.reset(token)

    async def scenario():
        first, s1 = submit(1)
        while not seen:
            await asyncio.sleep(0.01)
        second, _ = submit(2)
        third, s3 = submit(3)
        fourth, s4 = submit(4)
        await _settle()
        second.cancel()
        await _settle()
        gate.set()
        assert [float((await f)[0]) for f in (first, third, fourth)] == [1.0, 3.0, 4.0]
        assert seen == [[1], [3, 4]] and batcher.dropped == 1 and batcher.batches == 2
        assert s1.batch_size == 1 and s3.batch_size == 2 and s3.first_in_batch and not s4.first_in_batch
        assert "backbone" in s3.stages and s3.run_s >= s3.stages["backbone"]

    try:
        asyncio.run(scenario())
    finally:
        batcher.close()


def test_micro_batcher_trims_after_a_batch_that_came_too_soon_once_it_is_idle():
    """A batch right after a trim is not trimmed for (at most one trim per interval), so its freed memory is
    trimmed once the queue has stayed empty for the interval: an idle server keeps no batch's free memory."""
    from types import SimpleNamespace

    import torch

    from clef_vllm.backends.base import MicroBatcher

    trims = []
    batcher = MicroBatcher(lambda batch: [torch.zeros(1) for _ in batch], trim_interval_s=0.3)
    batcher._trim = lambda pad: trims.append(batcher.batches)

    async def scenario():
        await batcher.submit(SimpleNamespace(num_tokens=1))        # trimmed after (the first trim is due)
        await batcher.submit(SimpleNamespace(num_tokens=2))        # too soon for its own trim
        for _ in range(200):
            if len(trims) == 2:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(scenario())
    finally:
        batcher.close()
    assert trims == [1, 2]

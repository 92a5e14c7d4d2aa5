"""Admission control (clef_vllm/server/admission.py) on its own: in-flight and queue bounds, interactive
requests before bulk records without starving them, and a cancelled waiter leaving no trace."""

from __future__ import annotations

import asyncio

import pytest


async def _settle(n: int = 5):
    for _ in range(n):
        await asyncio.sleep(0)


def test_admission_order_priority_bound_and_cancellation():
    from clef_vllm.server.admission import BULK, INTERACTIVE, Admission, QueueFull

    async def scenario():
        adm = Admission(max_in_flight=1, max_queue=1)
        await adm.acquire()
        order = []

        async def waiter(tag, kind):
            await adm.acquire(kind)
            order.append(tag)

        bulk = asyncio.create_task(waiter("bulk", BULK))
        await _settle()
        inter = asyncio.create_task(waiter("interactive", INTERACTIVE))
        await _settle()
        with pytest.raises(QueueFull):                  # interactive queue (1) full; bulk waits unbounded
            await adm.acquire(INTERACTIVE)
        adm.release(0.5)
        await _settle()
        assert order == ["interactive"]                 # interactive before an older bulk waiter
        adm.release(0.5)
        await _settle()
        assert order == ["interactive", "bulk"] and adm.in_flight == 1
        late = asyncio.create_task(waiter("late", INTERACTIVE))
        await _settle()
        late.cancel()
        await asyncio.gather(late, bulk, inter, return_exceptions=True)
        assert adm.waiting() == 0
        assert adm.retry_after() == 1
        adm.release()
        assert adm.in_flight == 0 and adm.idle
        # a saturating interactive load does not starve bulk records: every 4th contended slot is theirs
        adm = Admission(max_in_flight=1, max_queue=16)
        await adm.acquire()
        order.clear()
        tasks = [asyncio.create_task(waiter(f"b{i}", BULK)) for i in range(2)]
        await _settle()
        tasks += [asyncio.create_task(waiter(f"i{i}", INTERACTIVE)) for i in range(8)]
        await _settle()
        for _ in range(4):
            adm.release()
            await _settle()
        assert order == ["i0", "i1", "i2", "b0"]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())

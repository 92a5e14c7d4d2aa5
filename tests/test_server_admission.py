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


def test_memory_budget_waits_in_order_lets_a_large_request_run_alone_and_forgets_a_cancelled_waiter():
    from clef_vllm.server.admission import MemoryBudget

    async def scenario():
        budget = MemoryBudget(100)
        running = []

        async def request(tag, n, until):
            async with budget.hold(n):
                running.append(tag)
                await until.wait()
                running.remove(tag)

        gates = {tag: asyncio.Event() for tag in "abcdef"}
        a = asyncio.create_task(request("a", 60, gates["a"]))
        b = asyncio.create_task(request("b", 60, gates["b"]))           # 120 > 100: waits for a
        c = asyncio.create_task(request("c", 30, gates["c"]))           # would fit, but b is ahead of it
        await _settle()
        assert running == ["a"] and (budget.held, budget.waiting) == (60, 2)
        gates["a"].set()
        await _settle()
        assert running == ["b", "c"] and (budget.held, budget.waiting) == (90, 0)
        big = asyncio.create_task(request("big", 500, gates["d"]))      # more than all of it: runs alone
        late = asyncio.create_task(request("late", 10, gates["e"]))
        await _settle()
        assert budget.waiting == 2 and "big" not in running
        gates["b"].set()
        gates["c"].set()
        await _settle()
        assert running == ["big"] and budget.held == 500
        gates["d"].set()
        await _settle()
        assert running == ["late"]
        gates["e"].set()
        await asyncio.gather(a, b, c, big, late)
        assert (budget.held, budget.waiting) == (0, 0)
        # a waiter cancelled at the head of the queue lets the ones behind it in
        first = asyncio.create_task(request("first", 80, gates["f"]))
        await _settle()
        head = asyncio.create_task(request("head", 50, asyncio.Event()))
        small = asyncio.create_task(request("small", 20, gates["f"]))
        await _settle()
        assert running == ["first"] and budget.waiting == 2
        head.cancel()
        await _settle()
        assert running == ["first", "small"] and (budget.held, budget.waiting) == (100, 0)
        gates["f"].set()
        await asyncio.gather(first, small, head, return_exceptions=True)
        assert (budget.held, budget.waiting) == (0, 0)
        unbounded = MemoryBudget(None)
        async with unbounded.hold(10 ** 12), unbounded.hold(10 ** 12):
            assert unbounded.held == 2 * 10 ** 12

    asyncio.run(scenario())

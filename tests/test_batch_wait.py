"""Rule 5's decision alone (``clef_vllm.worker.batch_wait``; the scheduler's use of it: tests/test_scheduler.py)
; the closed-loop simulation that compares its modes: tests/test_bench.py)."""

from __future__ import annotations

import pytest

from clef_vllm.worker.batch_wait import PEAK_WINDOW_S, BatchWait


def _hold(rule: BatchWait, now: float, waiting: int, oldest: float, tokens: int = 100, budget: int = 1000,
          running: int = 0) -> bool:
    return rule.hold(now, running=running, waiting=waiting, oldest=oldest, waiting_tokens=lambda: tokens,
                     budget=budget)


def test_half_holds_fewer_than_half_the_recent_peak_for_at_most_the_limit_from_the_oldest_arrival():
    rule = BatchWait(0.002)
    assert not _hold(rule, 1.0, 1, 1.0)                      # no step yet: a peak of 0
    rule.stepped(1.0, 8)
    assert _hold(rule, 1.1, 3, 1.1) and not _hold(rule, 1.1, 4, 1.1)      # 3 < 4 = half of 8
    assert not _hold(rule, 1.1, 3, 1.0979)                   # the oldest waited 2.1 ms
    assert not _hold(rule, 1.1, 3, 1.1, running=1)           # something runs: never
    assert not _hold(rule, 1.0 + PEAK_WINDOW_S + 0.01, 1, 2.0)            # the large step is forgotten
    assert rule.held_steps == 1


def test_refill_counts_from_the_idle_moment_waits_for_the_answered_clients_and_for_room():
    rule = BatchWait(0.005, "refill")
    assert not _hold(rule, 1.0, 2, 1.0)                      # nothing answered yet
    rule.stepped(1.0, 4)
    rule.finished(1.2, 4, running=0)                         # four answered at 1.2 s
    assert _hold(rule, 1.2, 2, 0.9)                          # two waited through the step: held from 1.2 s
    assert not _hold(rule, 1.2051, 2, 0.9)                   # 5.1 ms after the engine went idle
    assert _hold(rule, 1.2051, 2, 1.2030)                    # a request that came later: its own 5 ms
    assert not _hold(rule, 1.2, 2, 0.9, tokens=700, budget=1000)          # 700 + 350 > 1000: no room, no hold
    for _ in range(4):
        rule.arrival()
    assert not _hold(rule, 1.201, 6, 0.9)                    # all four back
    rule.finished(1.3, 2, running=1)                         # something still runs: the idle moment stays
    assert rule.idle_since == 1.2 and rule.answered == 4
    with pytest.raises(ValueError, match="batch wait mode 'full'"):
        BatchWait(0.002, "full")

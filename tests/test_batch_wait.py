"""Rule 5's decision alone (``clef_vllm.worker.fast.batch_wait``; the scheduler's use of it: tests/test_scheduler.py,
the stepped stand-in engine's: tests/test_bench_scripts.py)."""

from __future__ import annotations

from clef_vllm.worker.fast.batch_wait import PEAK_WINDOW_S, BatchWait


def _hold(rule: BatchWait, now: float, waiting: int, oldest: float, running: int = 0) -> bool:
    return rule.hold(now, running=running, waiting=waiting, oldest=oldest)


def test_half_holds_fewer_than_half_the_recent_peak_for_at_most_the_limit_from_the_oldest_arrival():
    rule = BatchWait(0.002)
    assert not _hold(rule, 1.0, 1, 1.0)                      # no step yet: a peak of 0
    rule.stepped(1.0, 8)
    assert _hold(rule, 1.1, 3, 1.1) and not _hold(rule, 1.1, 4, 1.1)      # 3 < 4 = half of 8
    assert not _hold(rule, 1.1, 3, 1.0979)                   # the oldest waited 2.1 ms
    assert not _hold(rule, 1.1, 3, 1.1, running=1)           # something runs: never
    assert not _hold(rule, 1.0 + PEAK_WINDOW_S + 0.01, 1, 2.0)            # the large step is forgotten
    assert rule.held_steps == 1

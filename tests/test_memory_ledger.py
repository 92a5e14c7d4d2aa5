"""The worker's memory ledger (clef_vllm.worker.memory): what the plugin's own GPU work takes after vLLM
sized its KV cache, and the report held against vLLM's budget. The allocator and the device are
stand-ins here; the GPU run logs the real figures (bench/results)."""

import logging

import pytest

from clef_vllm.worker import memory

GIB = 1 << 30


class FakeDevice:
    def __init__(self, reserved_gib: float, total_gib: float = 100.0):
        self.reserved = int(reserved_gib * GIB)
        self.total = int(total_gib * GIB)

    def ledger(self, fraction: float | None = 0.5) -> memory.Ledger:
        ledger = memory.Ledger(reserved=lambda: self.reserved, allocated=lambda: self.reserved - GIB,
                               total=lambda: self.total)
        ledger.budget_fraction = fraction
        return ledger


def test_taking_counts_reserved_growth_per_kind_even_when_the_work_fails():
    dev = FakeDevice(40)
    ledger = dev.ledger()
    with ledger.taking(memory.STEP_GRAPHS):
        dev.reserved += 2 * GIB
    with pytest.raises(RuntimeError), ledger.taking(memory.STEP_GRAPHS):
        dev.reserved += GIB // 2
        raise RuntimeError("capture failed")
    with ledger.taking(memory.HEAD_GRAPHS):
        dev.reserved += GIB
    assert ledger.taken[memory.STEP_GRAPHS] == 2.5 * GIB and ledger.times[memory.STEP_GRAPHS] == 2
    assert ledger.taken[memory.HEAD_GRAPHS] == GIB and ledger.dirty


def test_report_within_and_beyond_the_budget():
    dev = FakeDevice(45)
    ledger = dev.ledger(0.5)                     # a 50 GiB budget
    with ledger.taking(memory.GDN_GRAPHS):
        dev.reserved += 3 * GIB
    level, line = ledger.report()
    assert level == logging.INFO
    assert "holds 48.00 GiB (47.00 GiB in use)" in line and "budget of 50.00 GiB" in line
    assert "--gpu-memory-utilization 0.5 of 100.0 GiB" in line and "GDN graphs 3.00 GiB (1x)" in line
    assert "step graphs" not in line             # kinds that never ran are not named
    with ledger.taking(memory.GEMM_WARMUP):
        dev.reserved += 4 * GIB                  # 52 GiB: 2 beyond
    level, line = ledger.report()
    assert level == logging.WARNING
    assert "2.00 GiB beyond the budget" in line and "--gpu-memory-utilization 0.480" in line
    assert memory.Ledger().report() is None      # no budget known: nothing to say


def test_settle_logs_the_first_overrun_once_then_every_gib_taken(caplog):
    dev = FakeDevice(49)
    ledger = dev.ledger(0.5)
    caplog.set_level(logging.INFO, logger="clef_vllm")

    def grow(gib):
        with ledger.taking(memory.STEP_GRAPHS):
            dev.reserved += int(gib * GIB)
        ledger.settle()
        lines = [r for r in caplog.records if r.getMessage().startswith("clef memory:")]
        caplog.clear()
        return lines

    assert grow(0.25) == []                          # small and within the budget: quiet
    over = grow(0.9)                                 # 50.15 GiB: the first overrun is said at once
    assert [r.levelno for r in over] == [logging.WARNING]
    assert grow(0.5) == []                           # still over, not 1 GiB more since: quiet
    assert len(grow(0.6)) == 1                       # 1.1 GiB taken since the last line
    assert not ledger.dirty
    ledger.log_report()                              # the periodic report always says it
    assert len([r for r in caplog.records if r.getMessage().startswith("clef memory:")]) == 1

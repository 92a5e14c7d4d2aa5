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

    def ledger(self, fraction: float | None = 0.5, used_over_reserved_gib: float | None = None) -> memory.Ledger:
        used = None if used_over_reserved_gib is None else \
            (lambda: self.reserved + int(used_over_reserved_gib * GIB))   # the CUDA context, kernels, workspaces
        ledger = memory.Ledger(reserved=lambda: self.reserved, allocated=lambda: self.reserved - GIB,
                               total=lambda: self.total, used=used or (lambda: None))
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


def test_taking_never_counts_a_negative_figure_when_the_capped_allocator_releases_cached_blocks_meanwhile():
    """A capture during which the allocator, at its cap, releases 3 GiB of cached blocks and obtains 1 GiB for the
    graph's pool counts 0 (a lower bound), not -2 GiB; the next capture that grows the reservations counts its
    growth."""
    dev = FakeDevice(40)
    ledger = dev.ledger()
    with ledger.taking(memory.STEP_GRAPHS):
        dev.reserved -= 3 * GIB                  # cached blocks released to make room
        dev.reserved += GIB                      # the graph pool's new segment
    with ledger.taking(memory.STEP_GRAPHS):
        dev.reserved += GIB // 2
    assert ledger.taken[memory.STEP_GRAPHS] == GIB // 2 and ledger.times[memory.STEP_GRAPHS] == 2
    line = ledger.report()[1]
    assert "step graphs 0.50 GiB (2x)" in line and "(reservations' growth, at least)" in line


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
    with ledger.taking(memory.HEAD_GRAPHS):
        dev.reserved += 4 * GIB                  # 52 GiB: 2 beyond
    level, line = ledger.report()
    assert level == logging.WARNING
    assert "2.00 GiB beyond the budget" in line and "--gpu-memory-utilization 0.480" in line
    assert "libraries' workspaces come on top" in line   # the allocator's figure only: the rest is unknown
    assert memory.Ledger().report() is None      # no budget known: nothing to say


def test_report_holds_the_drivers_count_for_the_process_against_the_budget_where_nvml_gives_it():
    dev = FakeDevice(47)
    ledger = dev.ledger(0.5, used_over_reserved_gib=4.5)   # 51.5 GiB by the driver's count, 47 in the allocator
    level, line = ledger.report()
    assert level == logging.WARNING
    assert "this process holds 51.50 GiB of the device, its allocator 47.00 GiB (46.00 GiB in use)" in line
    assert "1.50 GiB beyond the budget: leave the device that much more, e.g. --gpu-memory-utilization 0.485" in line
    dev.reserved -= 2 * GIB                                 # 49.5 by the driver's count: within
    assert ledger.report()[0] == logging.INFO


def test_settle_logs_the_first_overrun_once_then_every_gib_more_held(caplog):
    dev = FakeDevice(49)
    ledger = dev.ledger(0.5)
    caplog.set_level(logging.INFO, logger="clef_vllm")

    def lines():
        got = [r for r in caplog.records if r.getMessage().startswith("clef memory:")]
        caplog.clear()
        return got

    def grow(gib, capture=True):
        if capture:
            with ledger.taking(memory.STEP_GRAPHS):
                dev.reserved += int(gib * GIB)
        else:                                        # the allocator grew under load (a new step shape)
            dev.reserved += int(gib * GIB)
        ledger.settle()
        return lines()

    assert len(grow(0.25)) == 1                      # the first look: 49.25 GiB held, 1 GiB more than nothing said
    over = grow(0.9)                                 # 50.15 GiB: the first overrun is said at once
    assert [r.levelno for r in over] == [logging.WARNING]
    queried = []
    ledger._used = lambda: queried.append(1)         # the driver's count is asked only to report
    assert grow(0.5) == []                           # still over, less than 1 GiB more since: quiet
    assert queried == []                             # and, the overrun said, the driver is not asked again
    assert len(grow(0.6, capture=False)) == 1        # 1.1 GiB more held since the last line, under load
    dev.reserved -= 3 * GIB                          # a capture emptied the cache: held shrinks, nothing to say
    assert grow(0.2) == []
    assert not ledger.dirty
    ledger.log_report()                              # the periodic report always says it
    assert len(lines()) == 1
    quiet = memory.Ledger()                          # not a GPU worker: settle() never says anything
    quiet.settle()
    assert lines() == []

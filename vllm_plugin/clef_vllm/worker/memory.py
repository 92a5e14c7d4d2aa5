"""What the plugin's own GPU work holds beside vLLM's memory budget.

vLLM sizes its KV cache so that the weights, the profiled peak of one step's activations and its
own CUDA graphs fit in ``--gpu-memory-utilization`` of the device. The plugin's graphs (the
prefill, step and head graphs), their static buffers and the head's GEMM warm-up allocate after
that sizing, so they come out of what the budget leaves of the device. :data:`LEDGER` counts, per
kind of work, how much the caching allocator's reserved memory grew while that work ran
(:meth:`Ledger.taking`), and :meth:`Ledger.report` says what the worker's process holds against
the budget: logged at the step after such work when it first holds more than the budget or has
taken another :data:`LOG_EVERY_BYTES` since it last said so (:meth:`Ledger.settle`; a few lines
during the server's warm-up), and with every periodic graph report.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable

import torch

log = logging.getLogger("clef_vllm")

GIB = float(1 << 30)

#: The kinds of plugin work the ledger counts, in the order the report names them.
STEP_GRAPHS, GDN_GRAPHS, HEAD_GRAPHS, GEMM_WARMUP = "step graphs", "GDN graphs", "head graphs", "GEMM warm-up"
#: :meth:`Ledger.settle` says so again after the plugin's work took this much more.
LOG_EVERY_BYTES = 1 << 30


def _reserved() -> int:
    return int(torch.cuda.memory_reserved()) if torch.cuda.is_available() else 0


def _allocated() -> int:
    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0


def _device_total() -> int:
    return int(torch.cuda.mem_get_info()[1]) if torch.cuda.is_available() else 0


class Ledger:
    """Reserved-memory growth per kind of plugin work, and the budget it is held against.

    ``reserved`` / ``allocated`` / ``total`` read the allocator and the device (injectable for tests);
    ``budget_fraction`` is vLLM's ``gpu_memory_utilization`` (``None``: not a GPU worker)."""

    def __init__(self, reserved: Callable[[], int] = _reserved, allocated: Callable[[], int] = _allocated,
                 total: Callable[[], int] = _device_total):
        self._reserved, self._allocated, self._total = reserved, allocated, total
        self.taken: Counter[str] = Counter()
        self.times: Counter[str] = Counter()
        self.budget_fraction: float | None = None
        self.dirty = False           # plugin work ran since the last settle()
        self._logged_taken = 0       # what had been taken when settle() last logged
        self._warned = False

    @contextlib.contextmanager
    def taking(self, what: str):
        """Count the reserved memory's growth while the block runs as ``what``'s (kept on failure too:
        a failed capture's pool stays reserved)."""
        before = self._reserved()
        try:
            yield
        finally:
            self.taken[what] += self._reserved() - before
            self.times[what] += 1
            self.dirty = True

    def report(self) -> tuple[int, str] | None:
        """``(level, line)`` saying what this process's allocator holds against vLLM's budget and what the
        plugin's work took of it; WARNING when the allocator holds more than the budget. ``None`` before
        the budget is known (not a GPU worker)."""
        if self.budget_fraction is None:
            return None
        total = self._total()
        budget = self.budget_fraction * total
        held = self._reserved()
        parts = [f"{what} {self.taken[what] / GIB:.2f} GiB ({self.times[what]}x)"
                 for what in (STEP_GRAPHS, GDN_GRAPHS, HEAD_GRAPHS, GEMM_WARMUP) if self.times[what]]
        line = (f"clef memory: the allocator holds {held / GIB:.2f} GiB ({self._allocated() / GIB:.2f} GiB in use) "
                f"against vLLM's budget of {budget / GIB:.2f} GiB (--gpu-memory-utilization {self.budget_fraction:g} "
                f"of {total / GIB:.1f} GiB); taken after vLLM sized its KV cache: "
                + (", ".join(parts) if parts else "nothing"))
        if held <= budget:
            return logging.INFO, line
        over = held - budget
        return logging.WARNING, (f"{line}. That is {over / GIB:.2f} GiB beyond the budget (the CUDA context and "
                                 f"libraries' workspaces come on top): leave the device that much more, e.g. "
                                 f"--gpu-memory-utilization {max(self.budget_fraction - over / total, 0.0):.3f}")

    def log_report(self, got: tuple[int, str] | None = None) -> None:
        """Log :meth:`report` (or ``got``, one just made; nothing before the budget is known)."""
        got = got or self.report()
        if got is not None:
            log.log(*got)
            self._logged_taken = sum(self.taken.values())
            self._warned = self._warned or got[0] >= logging.WARNING

    def settle(self) -> None:
        """After plugin work (the next step's start): log the report when the allocator first holds more than
        the budget, or the work has taken :data:`LOG_EVERY_BYTES` more since the report was last logged."""
        self.dirty = False
        got = self.report()
        if got is None:
            return
        if (got[0] >= logging.WARNING and not self._warned) or \
                sum(self.taken.values()) - self._logged_taken >= LOG_EVERY_BYTES:
            self.log_report(got)


#: The worker process's ledger.
LEDGER = Ledger()

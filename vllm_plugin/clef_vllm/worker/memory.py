"""What the plugin's own GPU work holds beside vLLM's memory budget.

vLLM sizes its KV cache so that the weights, the profiled peak of one step's activations and its
own CUDA graphs fit in ``--gpu-memory-utilization`` of the device. The plugin's graphs (the
prefill, step and head graphs), their static buffers and the head's GEMM warm-up allocate after
that sizing, so they come out of what the budget leaves of the device. :data:`LEDGER` counts, per
kind of work, how much the caching allocator's reserved memory grew while that work ran
(:meth:`Ledger.taking`), and :meth:`Ledger.report` says what the worker's process holds against
the budget. :meth:`Ledger.settle` looks at the step after such work and every
:data:`CHECK_EVERY_STEPS` steps (the allocator also grows under load: steps of new shapes), and logs
the report when the allocator first holds more than the budget or holds another
:data:`LOG_EVERY_BYTES` since the report was last logged (a few lines during the server's warm-up);
the periodic graph report logs it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable

import torch

log = logging.getLogger("clef_vllm")

GIB = float(1 << 30)

#: The kinds of plugin work the ledger counts, in the order the report names them.
STEP_GRAPHS, GDN_GRAPHS, HEAD_GRAPHS = "step graphs", "GDN graphs", "head graphs"
#: :meth:`Ledger.settle` logs the report again once the allocator holds this much more than when it last did.
LOG_EVERY_BYTES = 1 << 30
#: ... and looks every this many steps besides the steps after the plugin's own work.
CHECK_EVERY_STEPS = 200


def _reserved() -> int:
    return int(torch.cuda.memory_reserved()) if torch.cuda.is_available() else 0


def _allocated() -> int:
    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def process_used() -> int | None:
    """This process's memory on its current device by the driver's count (NVML, as ``nvidia-smi`` shows it: the
    allocator's reservations plus the CUDA context, kernels and libraries' workspaces); ``None`` where NVML
    cannot say (no NVML, or the process not listed, e.g. in another PID namespace)."""
    if not torch.cuda.is_available():
        return None
    try:
        from vllm.third_party import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(torch.cuda.current_device()))
        pid = os.getpid()
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - a figure for a log line: without NVML the line goes without it
        return None
    return None


def _device_total() -> int:
    return int(torch.cuda.mem_get_info()[1]) if torch.cuda.is_available() else 0


class Ledger:
    """Reserved-memory growth per kind of plugin work, and the budget it is held against.

    ``reserved`` / ``allocated`` / ``used`` / ``total`` read the allocator, the driver's count for this process
    and the device (injectable for tests); ``budget_fraction`` is vLLM's ``gpu_memory_utilization`` (``None``:
    not a GPU worker)."""

    def __init__(self, reserved: Callable[[], int] = _reserved, allocated: Callable[[], int] = _allocated,
                 total: Callable[[], int] = _device_total, used: Callable[[], int | None] = process_used):
        self._reserved, self._allocated, self._total, self._used = reserved, allocated, total, used
        self.taken: Counter[str] = Counter()
        self.times: Counter[str] = Counter()
        self.budget_fraction: float | None = None
        #: What :class:`~clef_vllm.worker.budget.ClefWorker` took out of the KV cache for the plugin's graphs.
        self.reserved_for_graphs: int | None = None
        self.dirty = False           # plugin work ran since the last settle()
        self._logged_held = 0        # what the allocator held when the report was last logged
        self._warned = False

    @contextlib.contextmanager
    def taking(self, what: str):
        """Count the growth of the allocator's reservations while the block runs as ``what``'s (kept on failure
        too: a failed capture's pool stays reserved). A block whose reservations did not grow counts 0: the
        allocator, capped at the budget (:mod:`clef_vllm.worker.budget`), may release cached blocks meanwhile to
        make room, so the count is a lower bound of what the captures hold, never a negative figure. (The
        allocator's cumulative count of new segments is no better: at the cap it releases and obtains segments
        over and over within one capture.)"""
        before = self._reserved()
        try:
            yield
        finally:
            self.taken[what] += max(self._reserved() - before, 0)
            self.times[what] += 1
            self.dirty = True

    def report(self) -> tuple[int, str] | None:
        """``(level, line)`` saying what this process holds against vLLM's budget (by the driver's count where
        NVML gives it, else the allocator's) and what the plugin's work took of it; WARNING when that is more
        than the budget. ``None`` before the budget is known (not a GPU worker)."""
        if self.budget_fraction is None:
            return None
        total = self._total()
        budget = self.budget_fraction * total
        held, used = self._reserved(), self._used()
        parts = [f"{what} {self.taken[what] / GIB:.2f} GiB ({self.times[what]}x)"
                 for what in (STEP_GRAPHS, GDN_GRAPHS, HEAD_GRAPHS) if self.times[what]]
        process = f"this process holds {used / GIB:.2f} GiB of the device, its allocator " if used is not None else \
            "the allocator holds "
        line = (f"clef memory: {process}{held / GIB:.2f} GiB ({self._allocated() / GIB:.2f} GiB in use) against "
                f"vLLM's budget of {budget / GIB:.2f} GiB (--gpu-memory-utilization {self.budget_fraction:g} of "
                f"{total / GIB:.1f} GiB); taken after vLLM sized its KV cache (reservations' growth, at least): "
                + (", ".join(parts) if parts else "nothing")
                + (f" (reserved for them: {self.reserved_for_graphs / GIB:.2f} GiB)"
                   if self.reserved_for_graphs is not None else ""))
        counted = used if used is not None else held
        if counted <= budget:
            return logging.INFO, line
        over = counted - budget
        beside = "" if used is not None else " (the CUDA context and libraries' workspaces come on top)"
        return logging.WARNING, (f"{line}. That is {over / GIB:.2f} GiB beyond the budget{beside}: leave the "
                                 f"device that much more, e.g. --gpu-memory-utilization "
                                 f"{max(self.budget_fraction - over / total, 0.0):.3f}")

    def log_report(self, got: tuple[int, str] | None = None) -> None:
        """Log :meth:`report` (or ``got``, one just made; nothing before the budget is known)."""
        got = got or self.report()
        if got is not None:
            log.log(*got)
            self._logged_held = self._reserved()
            self._warned = self._warned or got[0] >= logging.WARNING

    def settle(self) -> None:
        """At a step after plugin work, or a periodic one: log the report when the allocator first holds more
        than the budget, or holds :data:`LOG_EVERY_BYTES` more than when the report was last logged."""
        if self.budget_fraction is None or _capturing():
            return                       # a graph capture (vLLM's) runs the model's forward: not now
        self.dirty = False
        if self._reserved() - self._logged_held >= LOG_EVERY_BYTES:
            self.log_report()
            return
        if self._warned:
            return                       # the overrun was said: only growth is news (no driver query per check)
        got = self.report()
        if got[0] >= logging.WARNING:
            self.log_report(got)


#: The worker process's ledger.
LEDGER = Ledger()

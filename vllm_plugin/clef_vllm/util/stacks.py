"""Thread stacks on demand, so a stuck process says where it is stuck.

Every process that loads the plugin (the server, and each vLLM engine core through the plugin's
registration) writes all its threads' Python stacks to stderr on ``SIGUSR1`` (``faulthandler``):
``kill -USR1 PID``. The vLLM backend sends that signal to its engine processes itself when a
warm-up step overruns (:data:`clef_vllm.backends.vllm_backend.WARMUP_STEP_TIMEOUT_S`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
_enabled = False


def enable_stack_dumps() -> bool:
    """Dump every thread's stack to stderr on :data:`STACK_SIGNAL` (idempotent); ``False`` where the
    platform has no such signal or stderr has no file descriptor (e.g. captured by a test runner)."""
    global _enabled
    if _enabled or STACK_SIGNAL is None:
        return _enabled
    try:
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError, OSError):
        return False
    _enabled = True
    return True


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux: ``SigCgt`` in ``/proc/PID/status``). A
    process without one would be killed by ``SIGUSR1``, so only those that catch it are asked."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def dump_descendant_stacks() -> list[int]:
    """Ask every descendant process that dumps stacks on :data:`STACK_SIGNAL` (vLLM's engine cores and
    workers load the plugin, so they do) for its stacks; the pids signalled."""
    if STACK_SIGNAL is None:
        return []
    try:
        import psutil
    except ImportError:
        return []
    pids = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        if not catches(child.pid, STACK_SIGNAL):
            continue
        try:
            os.kill(child.pid, STACK_SIGNAL)
            pids.append(child.pid)
        except OSError:
            pass
    return pids

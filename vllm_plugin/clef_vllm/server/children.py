"""Nothing the server started outlives it.

vLLM starts its engine cores (one per ``--dp`` rank) as ``multiprocessing`` children of the server,
forked from the thread that loads the model. Two rules keep such a child from running on, holding
its GPU memory, after the server is gone:

* **A forked child does not keep the server's signal handlers.** After ``fork`` a child runs the
  handlers its parent had: uvicorn's, which here start the server's graceful drain on a loop that
  does not run in the child, so the child ignores ``SIGTERM`` and ``SIGINT``. vLLM installs its own
  only once the engine is up, and an engine start can take minutes (compilation, graph capture, a
  CUDA context that loads every kernel eagerly: 5 min 43 s on an H200), so a server stopped while
  loading had left an engine starting on, unkillable but by ``SIGKILL``. Every child forked
  after :func:`default_signals_in_forked_children` starts with the default dispositions instead,
  and a signal sent to it while it is being forked waits until they are in place.
* **The server stops its children on the way out.** :func:`stop_children` runs after the server
  loop ends, whatever ended it (a drain, a load failure or ``--load-timeout``, a dead engine, a
  second signal): each child still running gets ``SIGTERM``, and ``SIGKILL`` if it is still there
  :data:`STOP_GRACE_S` seconds later. After a normal shutdown the backend has already stopped the
  engine and nothing is left to do.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

#: How long a child may take to exit after ``SIGTERM`` before it is killed.
STOP_GRACE_S = 5.0

log = logging.getLogger("clef_vllm")
_registered = False


#: the signals a forked child gets back with their default dispositions
_RESET = (signal.SIGTERM, signal.SIGINT)
#: the forking thread's signal mask from just before a fork (restored after it, in parent and child)
_mask = threading.local()


def _block_before_fork() -> None:
    """Hold ``SIGTERM``/``SIGINT`` in the forking thread across the fork: a signal sent to the child
    before it has reset its handlers then waits, blocked, instead of reaching the parent's handler
    (a Python handler that a reset to the default later skips: the signal would be lost)."""
    _mask.saved = signal.pthread_sigmask(signal.SIG_BLOCK, _RESET)


def _restore_after_fork() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, _mask.saved)


def _default_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _restore_after_fork()               # a signal held since the fork is delivered now, to the default


def default_signals_in_forked_children() -> None:
    """From now on, a child forked by this process starts with ``SIGTERM`` terminating it and
    ``SIGINT`` raising ``KeyboardInterrupt`` (Python's defaults), whatever handlers the parent has
    installed, including a signal sent to it while it was being forked (idempotent)."""
    global _registered
    if not _registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_block_before_fork, after_in_parent=_restore_after_fork,
                            after_in_child=_default_signals)
        _registered = True


def stop_children(grace_s: float = STOP_GRACE_S) -> list[str]:
    """Stop every ``multiprocessing`` child of this process that is still running: ``SIGTERM``, then
    ``SIGKILL`` after ``grace_s`` seconds. Returns one line per child stopped (also logged)."""
    children = [p for p in multiprocessing.active_children() if p.pid is not None]
    if not children:
        return []
    log.warning("%d process(es) this server started are still running at exit: %s; sending SIGTERM",
                len(children), ", ".join(f"{p.name} (pid {p.pid})" for p in children))
    for p in children:
        p.terminate()
    deadline = time.monotonic() + grace_s
    report = []
    for p in children:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            log.warning("%s (pid %d) was still running %g s after SIGTERM: killed", p.name, p.pid, grace_s)
            p.kill()
            p.join(1.0)
            report.append(f"{p.name} (pid {p.pid}): killed")
        else:
            report.append(f"{p.name} (pid {p.pid}): exited ({p.exitcode})")
    return report

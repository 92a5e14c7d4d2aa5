"""Keep a long-running process's start-up objects out of Python's full garbage collections, and its native
caches bounded."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Callable, Iterator


def freeze_heap() -> tuple[int, float]:
    """Collect, then freeze every object the process holds (``gc.freeze``): the libraries, the tokenizer, a
    backend and what a warm-up left are never garbage, but each full collection walks them all. With torch,
    transformers and vLLM's client loaded that is ~570,000 objects, ~0.4 s a full collection on a 2-core machine,
    and under load the interpreter runs one every ~7 s: in a server's event loop no answer leaves and no request is
    read meanwhile (bench/results/cpu_gc_full_collections_*.json: 369-435 ms each, 4-11 ms once frozen). vLLM's own
    API server freezes its heap after start-up the same way. The server calls this once loaded. Returns (objects
    frozen, the collection's milliseconds)."""
    t0 = time.perf_counter()
    gc.collect()
    took_ms = (time.perf_counter() - t0) * 1000.0
    gc.freeze()
    return gc.get_freeze_count(), took_ms


#: oneDNN primitives kept per process (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; oneDNN's default is 1,024). On CPU
#: the reference backend's batches come in ever-new shapes and each shape's primitives were kept: per-minute
#: RSS floors rose 0.92 -> 1.5 GB over a 30-minute soak, and 0.94 -> 1.12 GB with 8 (docs/operating.md).
ONEDNN_PRIMITIVE_CACHE = 8
#: Computations kept by ideep, PyTorch's oneDNN layer (``LRU_CACHE_CAPACITY``; its default is 1,024). Each
#: bfloat16 ``linear`` on a CPU with AVX-512 BF16 or AMX goes through it, and each new input shape adds an entry
#: of 0.25-0.5 MB of malloc'd memory that is never freed while it is kept (pytorch/pytorch#27971): a server whose
#: batches come in ever-new shapes fills all 1,024, ~240 MB over its first minutes under the adversarial soak
#: (800 shapes of one linear keep 207 MB of heap in use, 10 MB with 32: tests/test_heap.py). 32 holds every
#: distinct linear of a forward pass (7 in the demo checkpoint), so the layers of one batch still share theirs.
IDEEP_COMPUTATION_CACHE = 32
#: glibc malloc arenas (``M_ARENA_MAX``; glibc's default is 8 per core). Each thread that allocates under
#: contention gets an arena, and each arena keeps its own fragments: a server under the adversarial soak held
#: ~790 MB in some twenty thread arenas of 35-56 MB resident each, against 190 MB in the main heap.
MALLOC_ARENAS = 2
#: Allocations of at least this many bytes are mapped on their own and unmapped when freed
#: (``M_MMAP_THRESHOLD``). Set, it also stops glibc raising the threshold (up to 32 MiB) after large frees,
#: which put request bodies and batch tensors inside the arenas' heaps, where they fragment.
MALLOC_MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8          # glibc's mallopt parameters (malloc.h)


def bound_native_caches(environ: dict | None = None) -> None:
    """Bound the native memory a long-running process keeps: oneDNN's primitive cache and ideep's computation
    cache (each read when first used), unless the environment already sets them; glibc's arenas and mmap threshold
    (``mallopt``: from this call on; without glibc, nothing), unless ``MALLOC_ARENA_MAX`` /
    ``MALLOC_MMAP_THRESHOLD_`` are set. Call it early, before the threads that allocate start."""
    environ = os.environ if environ is None else environ
    environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE))
    environ.setdefault("LRU_CACHE_CAPACITY", str(IDEEP_COMPUTATION_CACHE))
    try:
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    if "MALLOC_ARENA_MAX" not in environ:
        mallopt(_M_ARENA_MAX, MALLOC_ARENAS)
    if "MALLOC_MMAP_THRESHOLD_" not in environ:
        mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """The process's objects so far out of the full collections while the block runs, given back after (no
    collection first: what is garbage now is freed at the next one after). clef-bench measures inside it: a ~0.4 s
    pause would stall every client, and an in-process raw engine's output handling, now and then, and a test calls
    its ``main`` in the test's own process. Yields the number of objects frozen."""
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()


#: A full collection at least this long (ms) is a long pause: the server logs each one once it is ready,
#: in a line that starts with :data:`LONG_PAUSE_LINE` (a log reader finds these lines by it).
LONG_PAUSE_MS = 50.0
LONG_PAUSE_LINE = "garbage collector: a full collection stopped the event loop"


class FullCollections:
    """Times this process's full (generation 2) garbage collections from :meth:`install` on: ``seconds`` in all
    (``clef_gc_pause_seconds`` on the server's /metrics), with ``keep_each`` each one as ``(unix time,
    milliseconds)`` in :attr:`each` (``bench/instant_server.py --gc-log``), and each one of at least
    ``long_ms`` handed to ``on_long`` (its milliseconds and how many unreachable objects it freed: the server logs
    them). One hook on ``gc.callbacks``."""

    def __init__(self, keep_each: bool = False, long_ms: float = LONG_PAUSE_MS,
                 on_long: Callable[[float, int], None] | None = None):
        self.seconds = 0.0
        self.each: list[tuple[float, float]] | None = [] if keep_each else None
        self.long_ms, self.on_long = long_ms, on_long
        self._began = 0.0

    def install(self) -> "FullCollections":
        gc.callbacks.append(self._on_gc)
        return self

    def _on_gc(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        self.seconds += took
        if self.each is not None:
            self.each.append((round(time.time(), 3), round(took * 1000.0, 2)))
        if self.on_long is not None and took * 1000.0 >= self.long_ms:
            self.on_long(took * 1000.0, int(info.get("collected", 0)))

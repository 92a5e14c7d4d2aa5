"""clef_vllm.util.heap's full-collection hook: its total, its per-collection log, and the long pauses the server
logs once serving."""

import gc
import logging
from types import SimpleNamespace

from clef_vllm.server.service import DRAINING, LOADING, READY, DecisionService
from clef_vllm.util.heap import FullCollections


def make_cycles(n):
    for _ in range(n):
        a, b = [], []
        a.append(b)
        b.append(a)


def test_full_collections_time_each_one_and_hand_long_ones_over():
    long = []
    hook = FullCollections(keep_each=True, long_ms=0.0, on_long=lambda ms, freed: long.append((ms, freed)))
    quiet = FullCollections(long_ms=1e9, on_long=lambda ms, freed: long.append(("never", ms)))
    gc.disable()                                     # no automatic collection frees the cycles first
    gc.collect()                                     # nor is the process's earlier garbage counted below
    hook.install(), quiet.install()
    try:
        gc.collect(1)                                # a younger generation: not counted
        assert hook.each == [] and long == []
        make_cycles(500)
        gc.collect()
        make_cycles(3)
        gc.collect()
    finally:
        gc.enable()
        gc.callbacks.remove(hook._on_gc)
        gc.callbacks.remove(quiet._on_gc)
    assert len(hook.each) == 2 and hook.seconds > 0 and quiet.seconds > 0
    (_, first), (_, second) = long                   # two lists a cycle, all freed
    assert 1000 <= first < 1100 and 6 <= second < 100
    assert all(ms >= 0 for ms, _ in long) and abs(sum(ms for ms, _ in long) / 1000 - hook.seconds) < 1e-6


def test_the_server_logs_a_long_pause_only_once_serving(caplog):
    caplog.set_level(logging.INFO, logger="clef_vllm")
    for status, said in ((LOADING, False), (READY, True), (DRAINING, True)):
        caplog.clear()
        DecisionService._long_gc_pause(SimpleNamespace(status=status, frozen_objects=0), 78.4, 1234)
        lines = [r for r in caplog.records if "garbage collector" in r.getMessage()]
        assert bool(lines) is said
        if said:
            assert lines[0].levelno == logging.WARNING
            assert "stopped the event loop for 78 ms (it freed 1234 unreachable objects" in lines[0].getMessage()


def test_the_server_caps_onednn_primitives_unless_the_environment_says_otherwise():
    from clef_vllm.util.heap import IDEEP_COMPUTATION_CACHE, ONEDNN_PRIMITIVE_CACHE, bound_native_caches

    env: dict = {"MALLOC_ARENA_MAX": "8", "MALLOC_MMAP_THRESHOLD_": "131072"}     # glibc's own settings stay
    bound_native_caches(env)
    del env["MALLOC_ARENA_MAX"], env["MALLOC_MMAP_THRESHOLD_"]
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_PRIMITIVE_CACHE),
                   "LRU_CACHE_CAPACITY": str(IDEEP_COMPUTATION_CACHE)}
    env = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}
    bound_native_caches(env)
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}


# bf16 linears of 800 new input shapes in a fresh process, bounded as the server bounds itself: the heap memory
# still in use after them (glibc's count, after a trim) is what ideep's computation cache keeps.
_NEW_SHAPES = """
import ctypes, sys
from clef_vllm.util.heap import bound_native_caches
bound_native_caches()
import torch

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
    print("skip"); sys.exit(0)

def in_use():
    libc.malloc_trim(0)
    return libc.mallinfo2().uordblks

weight = torch.randn(256, 128, dtype=torch.bfloat16)
with torch.inference_mode():
    torch.nn.functional.linear(torch.randn(3, 128, dtype=torch.bfloat16), weight)
    before = in_use()
    for rows in range(1, 801):
        torch.nn.functional.linear(torch.randn(rows, 128, dtype=torch.bfloat16), weight)
    print((in_use() - before) / 2 ** 20)
"""


def test_new_input_shapes_keep_no_more_than_the_bounded_caches(tmp_path):
    """Unbounded (ideep's 1,024 computations), 800 shapes keep ~200 MB of heap; bounded, ~10 MB."""
    import os
    import subprocess
    import sys

    import pytest

    if not os.path.exists("/proc/self/maps") or sys.platform != "linux":
        pytest.skip("glibc's mallinfo2 on Linux")
    env = {k: v for k, v in os.environ.items()
           if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "MALLOC_ARENA_MAX",
                        "MALLOC_MMAP_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", _NEW_SHAPES], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.split()[-1]
    if last == "skip":
        pytest.skip("this CPU's bfloat16 matmuls do not go through oneDNN")
    assert float(last) < 50, f"{last} MB of heap kept after 800 new input shapes"

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
        DecisionService._long_gc_pause(SimpleNamespace(status=status), 78.4, 1234)
        lines = [r for r in caplog.records if "garbage collector" in r.getMessage()]
        assert bool(lines) is said
        if said:
            assert lines[0].levelno == logging.WARNING
            assert "stopped the event loop for 78 ms (it freed 1234 unreachable objects" in lines[0].getMessage()


def test_the_server_caps_onednn_primitives_unless_the_environment_says_otherwise():
    from clef_vllm.util.heap import ONEDNN_PRIMITIVE_CACHE, bound_native_caches

    env: dict = {"MALLOC_ARENA_MAX": "8", "MALLOC_MMAP_THRESHOLD_": "131072"}     # glibc's own settings stay
    bound_native_caches(env)
    del env["MALLOC_ARENA_MAX"], env["MALLOC_MMAP_THRESHOLD_"]
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_PRIMITIVE_CACHE)}
    env = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}
    bound_native_caches(env)
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"

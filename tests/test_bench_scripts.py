"""The maintained CPU-side bench scripts: ``bench/instant_server.py``'s stepped stand-in engine (on a virtual
clock), ``bench/front_end_ab.py`` against two instant servers, and ``bench/latency.py``'s bucket sweep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.virtual_clock import VirtualClock


def bench_script(name: str):
    """``bench/NAME.py`` as a module (the bench scripts are not a package; tests must not import them by name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"clef_bench_{name}", Path(__file__).resolve().parents[1]
                                                  / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stepped_engine_on(clock: VirtualClock, monkeypatch):
    """``bench/instant_server.py``'s :class:`SteppedEngine`, its clock (the batch wait's) the virtual one."""
    module = bench_script("instant_server")
    monkeypatch.setattr(module, "monotonic", lambda: clock.now)
    return module.SteppedEngine


def test_the_stepped_engine_batches_like_vllm_steps(monkeypatch):
    """bench/instant_server.py's stand-in engine: requests waiting when a step begins finish together after
    that step; one arriving during a step waits for the next; a step takes at most its token budget (and at
    least one request, however long); a step lasts its fixed cost plus its per-token cost."""
    import asyncio

    clock = VirtualClock(monkeypatch)
    SteppedEngine = stepped_engine_on(clock, monkeypatch)

    engine = SteppedEngine(fixed_ms=30, per_token_us=10, budget=1000)
    assert engine.step_seconds(2000) == pytest.approx(0.05)
    steps = []                                            # each step's tokens and seconds, as the engine sleeps them
    step_seconds = engine.step_seconds
    engine.step_seconds = lambda tokens: steps.append((tokens, step_seconds(tokens))) or steps[-1][1]

    async def scenario():
        finished = {}

        async def request(name, tokens, delay=0.0):
            await asyncio.sleep(delay)
            await engine.run(tokens)
            finished[name] = (engine.steps, clock.now)

        await asyncio.gather(request("a", 400), request("b", 400), request("late", 100, delay=0.01),
                             request("over", 300))       # a + b + over > 1,000 tokens: "over" waits too
        await request("huge", 5000)                       # alone, over the budget: a step of its own
        return finished

    finished = clock.run(scenario())
    assert {name: n for name, (n, _) in finished.items()} == {"a": 1, "b": 1, "over": 2, "late": 2, "huge": 3}
    assert engine.steps == 3 and engine.requests_per_step == {2: 2, 1: 1}
    # each step its fixed and per-token cost, one after another
    assert steps == [(800, pytest.approx(0.038)), (400, pytest.approx(0.034)), (5000, pytest.approx(0.080))]
    assert finished["a"][1] == pytest.approx(0.038) and finished["late"][1] == pytest.approx(0.072)
    assert finished["huge"][1] == pytest.approx(0.152)


def test_the_stepped_engine_holds_by_the_schedulers_batch_wait(monkeypatch):
    """With ``--batch-wait-ms`` the stand-in engine decides with the scheduler's own rule 5: after a step of
    four, a lone arrival is held (polling each millisecond) and joins the one that follows it 3 ms later;
    without the wait it runs alone (a virtual clock: the 3 ms are exact)."""
    import asyncio

    from clef_vllm.worker.fast.batch_wait import BatchWait

    clock = VirtualClock(monkeypatch)
    SteppedEngine = stepped_engine_on(clock, monkeypatch)

    def run(wait_ms):
        engine = SteppedEngine(fixed_ms=5, per_token_us=0, budget=1000, batch_wait=BatchWait(wait_ms / 1000))

        async def scenario():
            await asyncio.gather(*(engine.run(10) for _ in range(4)))
            second = asyncio.ensure_future(engine.run(10))
            await asyncio.sleep(0.003)
            await asyncio.gather(second, engine.run(10))

        clock.run(scenario())
        return engine

    held = run(20)
    assert held.requests_per_step == {4: 1, 2: 1} and held.batch_wait.held_steps >= 2
    plain = run(0)
    assert plain.requests_per_step == {4: 1, 1: 2} and plain.batch_wait.held_steps == 0


def test_front_end_ab_alternates_two_instant_servers_and_reports_b_over_a(tiny_release, tmp_path):
    """bench/front_end_ab.py: two instant servers with their own flags (here the CPU pool for every body vs
    the default), clef-bench against each in alternating rounds, medians and B over A per concurrency; the
    stage times show where each side did its CPU work."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, str(root / "bench/front_end_ab.py"), str(tiny_release), "--a",
                           "--cpu-inline-bytes 0", "--b", "", "-c", "2", "-n", "16", "--rounds", "2", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    (point,) = result["points"]
    assert point["concurrency"] == 2 and len(point["rounds"]["a"]) == len(point["rounds"]["b"]) == 2
    assert point["b_over_a_req_per_s"] == round(point["b"]["req_per_s"] / point["a"]["req_per_s"], 3)
    assert {"parse", "encode", "engine", "total"} <= set(point["a"]["stages_p50_ms"])
    assert "B/A" in proc.stdout and result["settings"]["a"] == "--cpu-inline-bytes 0"


def test_latency_py_sweeps_a_bucket_at_every_size_and_keeps_the_generic_ones_outside():
    """``bench/latency.py --sweep LO:HI:STEP`` gives the prefill graphs a bucket at every swept size (the generic
    ones outside the range), so one request of each size runs at its own size; a range it cannot sweep is refused."""
    from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS

    latency = bench_script("latency")
    sizes = latency.sweep_sizes("256:320:16")
    assert sizes == [256, 272, 288, 304, 320]
    buckets = latency.sweep_buckets(sizes)
    assert [b for b in buckets if 256 <= b <= 320] == sizes
    assert [b for b in buckets if b < 256 or b > 320] == [b for b in DEFAULT_BUCKETS if b < 256 or b > 320]
    for bad in ("256:320", "320:256:16", "250:300:16", "a:b:c"):
        with pytest.raises(ValueError):
            latency.sweep_sizes(bad)

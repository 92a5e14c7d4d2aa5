"""Several data-parallel engines on one GPU (--engines-per-gpu): options, placement, one start at a time."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from clef_vllm.backends.options import OptionError, backend_options, engine_args
from clef_vllm.contract import WorkerSettings
from clef_vllm.worker.fast import shared_gpu


def test_engines_per_gpu_reach_the_engine_as_the_worker_class_and_each_engine_gets_its_share_of_memory():
    one = engine_args(backend_options("vllm", {}))
    assert one["gpu_memory_utilization"] == 0.9 and one["worker_cls"] == "clef_vllm.worker.budget.ClefWorker"
    assert WorkerSettings.of(SimpleNamespace(**one)).engines_per_gpu == 1
    two = engine_args(backend_options("vllm", {"data_parallel_size": 4, "engines_per_gpu": 2}))
    assert two["worker_cls"] == "clef_vllm.worker.fast.shared_gpu.SharedGpuWorker"
    assert WorkerSettings.of(SimpleNamespace(**two)).engines_per_gpu == 2
    assert two["gpu_memory_utilization"] == 0.425                # 0.9 split, less headroom for the second engine
    four = engine_args(backend_options("vllm", {"data_parallel_size": 4, "engines_per_gpu": 4}))
    assert four["gpu_memory_utilization"] == 0.1875
    assert two["data_parallel_size"] == 4
    given = engine_args(backend_options("vllm", {"data_parallel_size": 2, "engines_per_gpu": 2,
                                                  "gpu_memory_utilization": 0.3}))
    assert given["gpu_memory_utilization"] == 0.3


@pytest.mark.parametrize("bad, match", [
    ({"engines_per_gpu": 2}, r"'engines_per_gpu' \(2\) places data-parallel engines: it cannot exceed "
                             r"data_parallel_size \(1\)"),
    ({"engines_per_gpu": 2, "data_parallel_size": 2, "gpu_memory_utilization": 0.6},
     r"'gpu_memory_utilization' is each engine's share of its GPU: 2 engines x 0.6 is more than the whole GPU \(at most 0.50"),
    ({"engines_per_gpu": 0, "data_parallel_size": 2}, r"'engines_per_gpu' must be >= 1"),
    ({"engines_per_gpu": 2, "data_parallel_size": 2, "engine_core": "thread"}, r"'engine_core' 'thread' runs one"),
])
def test_bad_engine_placements_are_refused_naming_the_option(bad, match):
    with pytest.raises(OptionError, match=match) as err:
        backend_options("vllm", bad)
    assert err.value.option in ("engines_per_gpu", "gpu_memory_utilization", "engine_core")


def test_the_flag_is_a_cli_error_naming_it(tiny_release, capsys):
    from clef_vllm.server.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_release), "--backend", "vllm", "--engines-per-gpu", "2"])
    assert exit_.value.code == 2
    assert "--engines-per-gpu" in capsys.readouterr().err


def test_the_engine_config_carries_the_worker_class(tiny_release):
    from vllm import AsyncEngineArgs

    from clef_vllm.backends.vllm_backend import engine_kwargs

    cfg = AsyncEngineArgs(**engine_kwargs(tiny_release, data_parallel_size=2, engines_per_gpu=2)).create_engine_config()
    assert cfg.parallel_config.worker_cls == "clef_vllm.worker.fast.shared_gpu.SharedGpuWorker"
    assert cfg.parallel_config.data_parallel_size == 2
    assert cfg.cache_config.gpu_memory_utilization == 0.425
    assert cfg.parallel_config.assigned_physical_gpu_ids is None   # placed by each engine's worker


def test_engines_are_placed_in_order_per_gpu_through_the_visible_devices():
    visible = ["3", "5", "6"]                                  # CUDA_VISIBLE_DEVICES=3,5,6
    physical = lambda i: int(visible[i])                       # noqa: E731 - vLLM's platform map
    assert [shared_gpu.engine_gpu(r, 2) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert shared_gpu.assigned_gpu_ids(0, 2, physical) == [3]
    assert shared_gpu.assigned_gpu_ids(3, 2, physical) == [3, 3, 5, 5]
    assert shared_gpu.assigned_gpu_ids(4, 2, physical) == [3, 3, 5, 5, 6]
    assert shared_gpu.assigned_gpu_ids(2, 1, physical) == [3, 5, 6]   # one a GPU: vLLM's own order
    with pytest.raises(ValueError):
        shared_gpu.engine_gpu(1, 0)


def _hold(path: str, events: str, everyone) -> None:
    """Start with the others (``everyone``: a barrier), then hold the lock a little, writing when it began and ended."""
    everyone.wait(10)
    lock = shared_gpu.StartLock(path)
    lock.acquire("test engine")
    with open(events, "a") as out:
        out.write(f"start {os.getpid()}\n")
        out.flush()
        time.sleep(0.1)                                       # room for another to barge in, were it not locked
        out.write(f"end {os.getpid()}\n")
    lock.release()


def _hold_and_die(path: str, ready) -> None:
    shared_gpu.StartLock(path).acquire("dying engine")
    ready.set()
    time.sleep(0.3)
    os._exit(3)                                               # no release: the OS drops the flock


def test_engines_on_one_gpu_start_one_at_a_time_across_processes(tmp_path):
    ctx = mp.get_context("fork")
    path = shared_gpu.start_lock_path(0, str(tmp_path))
    events = tmp_path / "events"
    everyone = ctx.Barrier(3)
    procs = [ctx.Process(target=_hold, args=(path, str(events), everyone)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(20)
        assert p.exitcode == 0
    lines = events.read_text().split("\n")[:-1]
    # never two at once: each start is followed by the same engine's end
    assert len(lines) == 6 and all(a == f"start {b.split()[1]}" and b.startswith("end ")
                                   for a, b in zip(lines[::2], lines[1::2])), lines
    assert {line.split()[1] for line in lines} == {str(p.pid) for p in procs}
    # another GPU's lock is another file: no waiting
    assert shared_gpu.start_lock_path(1, str(tmp_path)) != path


def test_an_engine_that_dies_while_starting_does_not_block_the_next(tmp_path):
    ctx = mp.get_context("fork")
    path = shared_gpu.start_lock_path(0, str(tmp_path))
    ready = ctx.Event()
    dying = ctx.Process(target=_hold_and_die, args=(path, ready))
    dying.start()
    assert ready.wait(10)
    probe = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):                  # held by the starting engine
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)
    lock = shared_gpu.StartLock(path)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lock.acquire, "next engine").result(timeout=60)   # waits for the death, not forever
    assert lock.held
    dying.join(5)
    assert dying.exitcode == 3
    lock.release()
    assert not lock.held


def test_the_worker_places_itself_and_holds_the_gpu_until_its_start_up_is_done(tmp_path, monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    seen = {}
    monkeypatch.setattr(shared_gpu.tempfile, "gettempdir", lambda: str(tmp_path))

    def fake_init_device(self):
        seen["ids"] = list(self.parallel_config.assigned_physical_gpu_ids)
        seen["held_in_init"] = self._clef_start_lock.held

    monkeypatch.setattr(Worker, "init_device", fake_init_device)
    monkeypatch.setattr(Worker, "compile_or_warm_up_model", lambda self: "compiled")
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_id_to_physical_device_id", lambda i: [4, 7][i], raising=False)
    worker = shared_gpu.SharedGpuWorker.__new__(shared_gpu.SharedGpuWorker)
    worker.vllm_config = SimpleNamespace(additional_config=WorkerSettings(engines_per_gpu=2).to_config())
    worker.parallel_config = SimpleNamespace(data_parallel_rank_local=1, assigned_physical_gpu_ids=None)
    worker.init_device()
    assert seen == {"ids": [4, 4], "held_in_init": True}       # engine 1 shares engine 0's GPU (physical 4)
    assert worker._clef_start_lock.path == str(tmp_path / "clef-vllm-gpu4.start.lock")
    other = shared_gpu.StartLock(worker._clef_start_lock.path)
    with pytest.raises(BlockingIOError):                       # still held between init_device and the warm-up
        import fcntl

        fd = os.open(other.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert worker.compile_or_warm_up_model() == "compiled"
    assert not worker._clef_start_lock.held
    assert other.acquire("after") < 1.0
    other.release()

    # a start that fails in vLLM's init_device lets the next engine go at once
    def failing(self):
        raise RuntimeError("no device")

    monkeypatch.setattr(Worker, "init_device", failing)
    broken = shared_gpu.SharedGpuWorker.__new__(shared_gpu.SharedGpuWorker)
    broken.vllm_config = worker.vllm_config
    broken.parallel_config = SimpleNamespace(data_parallel_rank_local=0, assigned_physical_gpu_ids=None)
    with pytest.raises(RuntimeError, match="no device"):
        broken.init_device()
    assert not broken._clef_start_lock.held

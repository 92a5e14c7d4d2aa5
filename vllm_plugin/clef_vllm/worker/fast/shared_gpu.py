"""Several data-parallel engines on one GPU (``--engines-per-gpu K``).

Why: data parallelism (state affinity, one engine per state) on a machine with fewer GPUs than engines.
It is not a speed option: one short decision's step is host-bound (docs/latency.md), but without MPS a GPU
runs one process's kernels at a time, and two 9B engines on one H200 served short decisions at 0.85x raw
vLLM's req/s where one engine serves 1.05x (docs/operating.md).

vLLM 0.28 runs data-parallel engines of a dense model as independent engine-core processes and puts
engine ``i`` on the ``i``-th visible GPU; its own ``--device-ids`` refuses to name a GPU twice. This
worker class (vLLM's ``worker_cls``, set by the backend's options) does two things before vLLM's
worker initialises its device:

* **Placement.** Engine ``i`` runs on visible GPU ``i // K``: the worker fills vLLM's
  ``assigned_physical_gpu_ids`` (the logical-to-physical map its ``--device-ids`` fills) so that its
  local rank maps to that GPU. vLLM's worker then sets the device and its process groups from that
  map as it does for ``--device-ids``.
* **One start at a time per GPU.** vLLM sizes an engine's KV cache from the device's free memory
  measured before and after a profiling step, assuming no other process changes its memory meanwhile.
  Two engines starting together on one GPU would each count the other's weights and activations as
  their own, or fail vLLM's check that free memory did not grow. So each engine holds a lock per GPU
  (an ``flock``-ed file, released by the OS if the process dies) from before vLLM's first memory
  snapshot until its start-up is done (KV cache allocated, graphs captured); the next engine then
  measures the GPU with the first one's memory already in place, as vLLM expects of other processes.
  Each engine's budget is ``--gpu-memory-utilization`` of the GPU (by default (0.9 - 0.05 (K-1)) / K:
  :attr:`~clef_vllm.backends.options.VllmOptions.resolved_gpu_memory_utilization`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time

from clef_vllm.contract import WorkerSettings
from clef_vllm.worker.budget import ClefWorker

log = logging.getLogger("clef_vllm")


def engine_gpu(dp_local_rank: int, per_gpu: int) -> int:
    """The visible GPU (index) of data-parallel engine ``dp_local_rank`` when ``per_gpu`` engines share each."""
    if per_gpu < 1 or dp_local_rank < 0:
        raise ValueError("per_gpu must be >= 1 and dp_local_rank >= 0")
    return dp_local_rank // per_gpu


def assigned_gpu_ids(dp_local_rank: int, per_gpu: int, physical) -> list[int]:
    """vLLM's ``assigned_physical_gpu_ids`` for engine ``dp_local_rank``: entry ``r`` is the physical id of the GPU
    of local rank ``r`` (vLLM's worker uses local rank = DP local rank with one GPU per engine), for every rank up
    to this engine's. ``physical`` maps a visible GPU index to its physical id (vLLM's platform does)."""
    return [int(physical(engine_gpu(rank, per_gpu))) for rank in range(dp_local_rank + 1)]


def start_lock_path(physical_gpu: int, folder: str | None = None) -> str:
    """The file whose ``flock`` lets one engine at a time start on a GPU (one per machine and GPU)."""
    return os.path.join(folder or tempfile.gettempdir(), f"clef-vllm-gpu{int(physical_gpu)}.start.lock")


class StartLock:
    """An exclusive ``flock`` on :func:`start_lock_path`, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, who: str = "engine") -> float:
        """Block until the lock is ours; returns the seconds waited (logged when another engine held it)."""
        if self._fd is not None:
            return 0.0
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        t0 = time.monotonic()
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("clef: %s waits for another engine on its GPU to finish starting (%s)", who, self.path)
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        waited = time.monotonic() - t0
        if waited > 0.5:
            log.info("clef: %s starts after waiting %.1f s for the GPU's other engine", who, waited)
        return waited

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


class SharedGpuWorker(ClefWorker):
    """The Clef worker (:mod:`clef_vllm.worker.budget`), placed ``--engines-per-gpu`` engines to a GPU and started one at a time per GPU."""

    def init_device(self):
        per_gpu = WorkerSettings.of(self.vllm_config).engines_per_gpu
        parallel = self.parallel_config
        rank = int(parallel.data_parallel_rank_local or 0)
        from vllm.platforms import current_platform

        ids = assigned_gpu_ids(rank, per_gpu, current_platform.device_id_to_physical_device_id)
        parallel.assigned_physical_gpu_ids = ids
        self._clef_start_lock = StartLock(start_lock_path(ids[rank]))
        self._clef_start_lock.acquire(f"engine {rank} (GPU {engine_gpu(rank, per_gpu)}, {per_gpu} engines a GPU)")
        log.info("clef: engine %d on visible GPU %d (physical %s), %d engines a GPU", rank, engine_gpu(rank, per_gpu),
                 ids[rank], per_gpu)
        try:
            return super().init_device()
        except BaseException:
            self._clef_start_lock.release()
            raise

    def compile_or_warm_up_model(self):
        try:
            return super().compile_or_warm_up_model()
        finally:
            lock = getattr(self, "_clef_start_lock", None)
            if lock is not None:
                lock.release()

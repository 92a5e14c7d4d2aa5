"""Multi-node data parallelism through vLLM's own machinery (docs/deploy.md, "Many hosts").

The head node runs ``clef-systemone --data-parallel-size N --data-parallel-size-local k
--data-parallel-address IP``: one HTTP front-end, vLLM's internal load balancing and the plugin's state
affinity over all N ranks (``data_parallel_rank=`` on ``add_request``). Every other node runs
``clef-systemone --headless --data-parallel-start-rank r ...``: its engines only, started by vLLM's engine
manager as ``vllm serve --headless`` starts them, which connect to the head's handshake port.

Bounds: a headless rank whose head does not answer fails after vLLM's handshake timeout
(``vllm.v1.engine.core.HANDSHAKE_TIMEOUT_MINS``, 5 minutes) and the node exits 1; a head whose remote ranks
never join stops waiting after ``--load-timeout`` (:data:`REMOTE_RANKS_LOAD_TIMEOUT_S` when not given) and
exits 1.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from clef_vllm.backends.engine_settings import remote_ranks
from clef_vllm.backends.options import VllmOptions

log = logging.getLogger("clef_vllm")

#: ``--load-timeout`` of a head node that waits for ranks on other nodes, when none is given (vLLM's head waits
#: for them without a bound)
REMOTE_RANKS_LOAD_TIMEOUT_S = 1800.0


def load_timeout(opts: VllmOptions | None, given: float | None) -> float | None:
    """The head's load bound: as given, else :data:`REMOTE_RANKS_LOAD_TIMEOUT_S` while ranks are remote."""
    if given or opts is None or not remote_ranks(opts):
        return given
    return REMOTE_RANKS_LOAD_TIMEOUT_S


def headless_config(model_dir: str | Path, opts: VllmOptions):
    """The ``VllmConfig`` of this node's engines: the head's engine arguments
    (:func:`~clef_vllm.backends.vllm_backend.engine_kwargs`) as vLLM builds them for a headless node."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from clef_vllm.backends.vllm_backend import engine_kwargs

    args = AsyncEngineArgs(**engine_kwargs(model_dir, opts))
    return args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER, headless=True)


def run_headless(model_dir: str | Path, opts: VllmOptions) -> int:
    """Start this node's engines and serve until they exit: 0 after SIGTERM/SIGINT, 1 when an engine exits on
    its own (it failed, or could not join the head) or the checkpoint is refused.

    The steps of vLLM's own ``vllm serve --headless`` (``vllm/entrypoints/cli/serve.py`` ``run_headless``):
    vLLM's engine manager starts ``data_parallel_size_local`` engines from ``data_parallel_rank`` on, which
    connect to ``tcp://data_parallel_master_ip:data_parallel_rpc_port``; without importing vLLM's API server."""
    from clef_vllm.backends.memory_fit import fit_options
    from clef_vllm.backends.vllm_backend import import_vllm
    from clef_vllm.model.checkpoint import CheckpointError, load_head_config, locate_checkpoint
    from clef_vllm.plan.memory_plan import PlanDoesNotFit
    from clef_vllm.plugin import register
    from clef_vllm.worker.dummy_loader import is_dummy

    try:
        files = locate_checkpoint(model_dir, require_weights=not is_dummy(opts.load_format))
        load_head_config(files)          # the version marker on this node too; each engine's worker checks again
        opts, _ = fit_options(files.root, opts)
    except (CheckpointError, PlanDoesNotFit) as exc:
        log.error("headless node: %s", exc)
        return 1
    import_vllm()
    register()
    from vllm.utils.network_utils import get_tcp_uri
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor import Executor

    config = headless_config(files.root, opts)
    parallel = config.parallel_config
    address = get_tcp_uri(parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port)
    log.info("headless node: data-parallel ranks %d-%d of %d, joining %s", parallel.data_parallel_rank,
             parallel.data_parallel_rank + parallel.data_parallel_size_local - 1, parallel.data_parallel_size, address)
    stopping = []

    def stop(signum, frame):
        if not stopping:
            stopping.append(signal.Signals(signum).name)
            raise SystemExit

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    manager = CoreEngineProcManager(
        local_engine_count=parallel.data_parallel_size_local, start_index=parallel.data_parallel_rank,
        local_start_index=0, vllm_config=config, local_client=False, handshake_address=address,
        executor_class=Executor.get_class(config), log_stats=False)   # disable_log_stats: FIXED_ENGINE_SETTINGS
    try:
        manager.monitor_engine_liveness()
    except SystemExit:
        pass
    finally:
        manager.shutdown(timeout=config.shutdown_timeout if stopping else None)
    if stopping:
        log.info("headless node: stopped (%s)", stopping[0])
        return 0
    log.error("headless node: an engine exited (%s failed, or could not join the head at %s); exiting",
              getattr(manager, "failed_proc_name", None) or "it", address)
    return 1

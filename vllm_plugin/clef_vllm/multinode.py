"""Multi-node data parallelism through vLLM's own machinery (docs/deploy.md, "Many hosts").

The head node runs ``clef-systemone --data-parallel-size N --data-parallel-size-local k
--data-parallel-address IP``: one HTTP front-end, vLLM's internal load balancing and the plugin's state
affinity over all N ranks (``data_parallel_rank=`` on ``add_request``). Every other node runs
``clef-systemone --headless --data-parallel-start-rank r ...``: its engines only, started by vLLM's own
headless path (``vllm.entrypoints.cli.serve.run_headless``), which connect to the head's handshake port.

Bounds: a headless rank whose head does not answer fails after vLLM's handshake timeout
(``vllm.v1.engine.core.HANDSHAKE_TIMEOUT_MINS``, 5 minutes) and the node exits 1; a head whose remote ranks
never join stops waiting after ``--load-timeout`` (:data:`REMOTE_RANKS_LOAD_TIMEOUT_S` when not given) and
exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from clef_vllm.backends.options import VllmOptions

log = logging.getLogger("clef_vllm")

#: ``--load-timeout`` of a head node that waits for ranks on other nodes, when none is given (vLLM's head waits
#: for them without a bound)
REMOTE_RANKS_LOAD_TIMEOUT_S = 1800.0


def remote_ranks(opts: VllmOptions) -> range:
    """The data-parallel ranks a head node leaves to ``--headless`` nodes (empty: all are here, or Ray places
    them)."""
    local = opts.data_parallel_size_local
    if opts.headless or local is None or opts.data_parallel_backend != "mp":
        return range(0)
    return range(local, opts.data_parallel_size)


def load_timeout(opts: VllmOptions | None, given: float | None) -> float | None:
    """The head's load bound: as given, else :data:`REMOTE_RANKS_LOAD_TIMEOUT_S` while ranks are remote."""
    if given or opts is None or not remote_ranks(opts):
        return given
    return REMOTE_RANKS_LOAD_TIMEOUT_S


def headless_args(model_dir: str | Path, opts: VllmOptions) -> argparse.Namespace:
    """The namespace ``vllm serve --headless`` would parse for this node's engines: every ``AsyncEngineArgs``
    field from :func:`~clef_vllm.backends.vllm_backend.engine_kwargs` (so the engines run exactly as the
    head's), plus ``headless`` and one API server (none runs)."""
    from vllm import AsyncEngineArgs

    from clef_vllm.backends.vllm_backend import engine_kwargs

    engine = AsyncEngineArgs(**engine_kwargs(model_dir, opts))
    ns = argparse.Namespace(**{f.name: getattr(engine, f.name) for f in dataclasses.fields(AsyncEngineArgs)})
    ns.headless, ns.api_server_count = True, 1
    return ns


def run_headless(model_dir: str | Path, opts: VllmOptions) -> int:
    """Start this node's engines and serve until they exit: 0 after SIGTERM/SIGINT, 1 when an engine exits on
    its own (it failed, or could not join the head) or the checkpoint is refused."""
    from clef_vllm import register
    from clef_vllm.backends.memory_fit import fit_options
    from clef_vllm.backends.vllm_backend import import_vllm
    from clef_vllm.checkpoint import CheckpointError, load_head_config, locate_checkpoint
    from clef_vllm.memory_plan import PlanDoesNotFit
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
    from vllm.entrypoints.cli.serve import run_headless as vllm_run_headless

    ns = headless_args(files.root, opts)
    first = opts.data_parallel_start_rank
    log.info("headless node: data-parallel ranks %d-%d of %d, joining %s:%s", first,
             first + opts.data_parallel_size_local - 1, opts.data_parallel_size, opts.data_parallel_address,
             ns.data_parallel_rpc_port or "vLLM's default port")
    try:
        vllm_run_headless(ns)
    except SystemExit:                   # vLLM's handler for SIGTERM / SIGINT: its engines are shut down
        log.info("headless node: stopped")
        return 0
    log.error("headless node: an engine exited (it failed, or could not join the head node); exiting")
    return 1

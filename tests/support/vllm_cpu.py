"""Run vLLM 0.28's model construction and weight loading on a CPU-only machine (docs/vllm-internals.md).

The CUDA wheel of vLLM imports on CPU with three shims: ``VLLM_TARGET_DEVICE=cpu`` (CpuPlatform),
an import-only ``torchvision`` stub (PyPI torchvision is a CUDA build that cannot load beside
CPU torch), and a Python stand-in for the ``_C.silu_and_mul`` op bound at construction. NVFP4
layers need vLLM's emulation kernel registered for the CPU platform. A single-process gloo group
stands in for the distributed setup. A full backbone forward is not possible on CPU (GDN and
attention kernels); the pooler and head are tested on synthetic hidden states instead.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

SITE = Path(__file__).parent / "vllm_cpu_site"
REPO = Path(__file__).resolve().parents[2]
_ready = False
_env_ready = False


def setup_env() -> None:
    """Environment shims; must run before vLLM is first imported (conftest does it at import)."""
    global _env_ready
    if _env_ready:
        return
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # Subprocesses (vLLM's model-inspection subprocess) get the torchvision stub via sitecustomize.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)
    from support.vllm_cpu_site import torchvision_stub  # noqa: F401  (installs the finder in this process)
    _env_ready = True


def setup() -> None:
    """Install all shims once per process (idempotent)."""
    global _ready
    if _ready:
        return
    setup_env()
    import torch
    import torch.nn.functional as F

    if not hasattr(torch.ops._C, "silu_and_mul"):
        lib = torch.library.Library("_C", "FRAGMENT")
        lib.define("silu_and_mul(Tensor! out, Tensor input) -> ()")

        def silu_and_mul(out, x):
            d = x.shape[-1] // 2
            out.copy_(F.silu(x[..., :d]) * x[..., d:])

        lib.impl("silu_and_mul", silu_and_mul, "CPU")
        setup._lib = lib  # keep the registration alive
    _register_cpu_nvfp4()
    _no_cpu_packed_gemm()
    _ready = True


def _no_cpu_packed_gemm() -> None:
    """On CPUs with AMX, vLLM's CPU platform repacks bf16 linear and conv weights with ``_C`` ops
    that exist only in vLLM's CPU build; without AMX it uses plain torch ops, which need none."""
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False


def _register_cpu_nvfp4() -> None:
    try:
        from vllm.model_executor.kernels.linear import register_linear_kernel
        from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
        from vllm.platforms import PlatformEnum
    except ImportError:  # layout differs: NVFP4 tests will say so
        return
    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")


_dist_ready = False


def init_distributed(vllm_config) -> None:
    """A single-process gloo group (once per process)."""
    global _dist_ready
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    if _dist_ready:
        return
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp(prefix='clef-gloo-')}")
        ensure_model_parallel_initialized(1, 1)
    _dist_ready = True


def vllm_config_for(checkpoint, load_format: str = "auto", max_model_len: int = 512,
                    settings=None, **model_kwargs):
    """A CPU ``VllmConfig`` serving ``checkpoint`` as ClefFlashForDecision (``settings``: the engine's
    :class:`~clef_vllm.contract.WorkerSettings`, as the backend's options set them; none: the defaults)."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    from clef_vllm import ARCHITECTURE

    model_kwargs.setdefault("hf_overrides", {"architectures": [ARCHITECTURE]})
    model_kwargs.setdefault("skip_tokenizer_init", False)     # as a seeing engine: its processor needs the tokenizer
    mc = ModelConfig(model=str(checkpoint), dtype="bfloat16", enforce_eager=True,
                     max_model_len=max_model_len, runner="pooling", **model_kwargs)
    return VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"),
                      load_config=LoadConfig(load_format=load_format),
                      additional_config=settings.to_config() if settings is not None else {})


def load_model(checkpoint, load_format: str = "auto", **model_kwargs):
    """Build and load ClefFlashForDecision through vLLM's own loader, on CPU."""
    setup()
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.models import ModelRegistry

    from clef_vllm import ARCHITECTURE
    from clef_vllm.worker.model import ClefFlashForDecision

    # In-process class registration (the entry point registers the lazy "module:Class" form).
    ModelRegistry.register_model(ARCHITECTURE, ClefFlashForDecision)
    import torch

    vc = vllm_config_for(checkpoint, load_format=load_format, **model_kwargs)
    init_distributed(vc)
    default_dtype = torch.get_default_dtype()       # vLLM's loader can leave bf16 as the default
    try:
        with set_current_vllm_config(vc):
            return get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=vc.model_config)
    finally:
        torch.set_default_dtype(default_dtype)


def scheduler_for(checkpoint, scheduler_cls: str, max_model_len: int, budget: int, block: int = 32,
                  state_cache: bool = False, num_blocks: int = 256, unit: int | None = None,
                  settings=None):
    """vLLM 0.28's real scheduler (class ``scheduler_cls``) for ``checkpoint`` on CPU, with a hybrid KV
    cache config of one attention and one GDN group (``align`` mode and prefix caching when
    ``state_cache``; ``unit``: vLLM's ``prefix_match_unit``, as ``--state-cache-match unit`` sets it).
    No worker: :func:`run_scheduler` stands in for the model runner's outputs."""
    setup()
    import torch
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.utils.hashing import sha256
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    import clef_vllm

    clef_vllm.register()
    mode = "align" if state_cache else "none"
    vc = vllm_config_for(checkpoint, max_model_len=max_model_len, settings=settings)
    vc.cache_config = CacheConfig(block_size=block, enable_prefix_caching=state_cache, mamba_cache_mode=mode,
                                  prefix_match_unit=unit)
    vc.cache_config.num_gpu_blocks = num_blocks
    vc.scheduler_config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=max_model_len,
                                          enable_chunked_prefill=True, is_encoder_decoder=False)
    groups = [KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8,
                                                           dtype=torch.bfloat16)),
              KVCacheGroupSpec(["gdn"], MambaSpec(block_size=block, shapes=((4, 8),), dtypes=(torch.float32,),
                                                  mamba_cache_mode=mode))]
    init_none_hash(sha256)
    cls = resolve_obj_by_qualname(scheduler_cls)
    return cls(vllm_config=vc, kv_cache_config=KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                                             kv_cache_groups=groups),
               structured_output_manager=StructuredOutputManager(vc), block_size=block,
               hash_block_size=unit or block, log_stats=False)


def pooling_request(scheduler, request_id: str, token_ids: list[int], clef: dict | None = None):
    """A pooling request as the engine core builds it (block hashes for the prefix cache, by the hasher
    the engine core builds: the plugin's, once registered); ``clef`` is the plugin's wire spec in the
    pooling params (``r``/``k``: the state cache's reuse information)."""
    from vllm import PoolingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.engine.core import get_request_block_hasher
    from vllm.v1.request import Request

    from clef_vllm.contract import PARAMS_KEY

    params = PoolingParams(task="plugin", extra_kwargs={PARAMS_KEY: clef} if clef else None)
    return Request(request_id, prompt_token_ids=list(token_ids), sampling_params=None, pooling_params=params,
                   block_hasher=get_request_block_hasher(scheduler.hash_block_size, sha256))


def pooling_metadata(specs, scheduled, seq_lens, states):
    """vLLM's ``PoolingMetadata`` for one step of the pooler: per request its head spec (``None``: vLLM's
    own warm-up request, no Clef params), its scheduled tokens, its computed length after the step and
    its ``PoolingStates``."""
    import numpy as np
    import torch
    from vllm import PoolingParams
    from vllm.v1.pool.metadata import PoolingMetadata

    from clef_vllm.contract import PARAMS_KEY

    params = [PoolingParams(task="plugin", extra_kwargs=None if s is None else {PARAMS_KEY: s.to_wire()})
              for s in specs]
    prompt_lens = torch.tensor([s.num_tokens if s is not None else n for s, n in zip(specs, seq_lens)])
    md = PoolingMetadata(prompt_lens=prompt_lens, prompt_token_ids=None, prompt_token_ids_cpu=None,
                         pooling_params=params, pooling_states=states)
    md.build_pooling_cursor(np.array(scheduled), torch.tensor(seq_lens), device=torch.device("cpu"))
    return md


def prompt_done(scheduler, ids) -> list[bool]:
    """Per request of ``ids``: whether its prompt is computed once the step just scheduled runs."""
    return [scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_prompt_tokens for rid in ids]


def runner_output(scheduler, out, done: list[bool] | None = None):
    """What the model runner answers for step ``out``: a pooled output for each request whose prompt the
    step completes (``done``: as :func:`prompt_done` said when the step was scheduled; default: now)."""
    import torch
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    done = prompt_done(scheduler, ids) if done is None else done
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                             pooler_output=[torch.zeros(1) if d else None for d in done])


def run_scheduler(scheduler, requests, max_steps: int = 50, depth: int = 1) -> dict[str, list[int]]:
    """Add ``requests``, then schedule steps, answering each with a pooled output once a request's
    prompt is computed (what the model runner does), until all finish or ``max_steps`` steps ran.
    ``depth`` 2 is vLLM's batch queue under async scheduling: the next step is scheduled before the
    previous one's output is back (the engine core's ``step_with_batch_queue``).
    Returns each request's chunk sizes; a request still unfinished has ``-1`` appended."""
    from collections import deque

    chunks: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        scheduler.add_request(r)
    in_flight = deque()
    for _ in range(max_steps):
        if not scheduler.requests:
            break
        out = scheduler.schedule(False)            # as vLLM's engine core calls it (throttle_prefills)
        ids = list(out.num_scheduled_tokens)
        for rid in ids:
            chunks[rid].append(out.num_scheduled_tokens[rid])
        in_flight.append((out, prompt_done(scheduler, ids)))     # what the model runner will pool
        if len(in_flight) < depth:
            continue
        out, done = in_flight.popleft()
        scheduler.update_from_output(out, runner_output(scheduler, out, done))
    for rid in scheduler.requests:
        chunks[rid].append(-1)
    return chunks


@contextlib.contextmanager
def bare_vllm_backend(**kwargs):
    """A ``VllmBackend`` made without ``__init__`` (no engine: the test sets ``engine`` to a stand-in for
    AsyncLLM) whose request path runs on its own loop thread; ``kwargs``: its engine settings. The loop
    stops on exit."""
    import asyncio
    import itertools
    import threading

    from clef_vllm.backends.vllm_backend import VllmBackend

    backend = object.__new__(VllmBackend)
    backend._ids = itertools.count()
    backend._loop = asyncio.new_event_loop()
    backend._thread = threading.Thread(target=backend._loop.run_forever, daemon=True)
    backend._thread.start()
    backend.kwargs = kwargs
    backend.state_cache = False                     # set by __init__ from the engine settings
    try:
        yield backend
    finally:
        backend._loop.call_soon_threadsafe(backend._loop.stop)
        backend._thread.join(10)

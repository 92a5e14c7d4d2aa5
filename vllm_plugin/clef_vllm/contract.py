"""What the vLLM backend (front-end) and the plugin's worker code agree on; imports only the standard library.

The front-end (:mod:`clef_vllm.backends.vllm_backend`) sends every request as
``PoolingParams(task=POOLING_TASK, extra_kwargs={PARAMS_KEY: HeadSpec.to_wire()})`` and starts the engine
with one :class:`WorkerSettings` (built from the backend's typed options by
:func:`clef_vllm.backends.engine_settings.worker_settings`). vLLM copies its config into every engine and
worker process and hashes ``additional_config`` as JSON, so the settings travel there as their plain form
(:meth:`WorkerSettings.to_config`, under :data:`SETTINGS_KEY`) and the worker rebuilds the same object
(:meth:`WorkerSettings.of`), checking every field again: an unknown key or a bad value stops the engine
with a message naming it. Nothing in the worker reads a setting any other way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

#: vLLM pooling task served by :class:`clef_vllm.worker.pooler.ClefPooler` (vLLM's task for a
#: model-defined pooler; ``PoolingParams.verify`` leaves its params alone).
POOLING_TASK = "plugin"
#: Key of the per-request head spec in ``PoolingParams.extra_kwargs`` (plain lists: msgpack-safe).
PARAMS_KEY = "clef"
#: Values the joint head's dtype may take.
HEAD_DTYPES = ("bfloat16", "float32")
#: What a prefill graph holds (``--prefill-graph-scope``): the GDN core, vLLM's whole packed GDN op, or the
#: whole backbone of a single-sequence step (over the core graphs).
PREFILL_GRAPH_SCOPES = ("core", "layer", "step")
#: ``--step-graph-split``'s default: with whole-step graphs, a step of up to this many prefill sequences replays each
#: one's step graph in turn (:attr:`PrefillGraphs.split`; below 2: never).
DEFAULT_STEP_GRAPH_SPLIT = 4
#: The values ``--head-graph-records`` may take: the record buckets (a step finishing R requests is padded to the
#: smallest >= R).
HEAD_GRAPH_RECORDS = (1, 2, 4, 8, 16, 32, 64)
#: vLLM's ``scheduler_cls`` for Clef engines, by ``--async-scheduling`` (off / on): the same rules, on vLLM's
#: synchronous ``Scheduler`` or its ``AsyncScheduler`` (:mod:`clef_vllm.worker.scheduler`).
SCHEDULER_CLASSES = {False: "clef_vllm.worker.scheduler.ClefScheduler",
                     True: "clef_vllm.worker.scheduler.ClefAsyncScheduler"}
#: ``--nvfp4-kernel`` values: vLLM's own choice (Marlin W4A16 before Blackwell, native W4A4 from it), BF16
#: GEMMs on weights dequantized at load, or ``auto``: BF16 GEMMs before Blackwell, vLLM's choice from it
#: (:func:`clef_vllm.quant.kernels.resolve_nvfp4_kernel`).
NVFP4_KERNELS = ("vllm", "bf16", "auto")
#: ``--nvfp4-kernel``'s default, for the server and for ``clef-load``'s prediction of it.
DEFAULT_NVFP4_KERNEL = "auto"
#: vLLM's ``worker_cls`` for a Clef engine: vLLM's GPU worker, with the plugin's memory taken out of the KV cache
#: and the allocator capped at the budget (:mod:`clef_vllm.worker.budget`).
CLEF_WORKER = "clef_vllm.worker.budget.ClefWorker"
#: vLLM's ``worker_cls`` for engines that share a GPU: it places them and starts them one at a time
#: (:mod:`clef_vllm.worker.fast.shared_gpu`).
SHARED_GPU_WORKER = "clef_vllm.worker.fast.shared_gpu.SharedGpuWorker"


#: ``additional_config`` key of the worker settings' plain form.
SETTINGS_KEY = "clef_worker"


class SettingsError(ValueError):
    """A worker setting that does not exist or has a bad value (``name`` names it)."""

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class PrefillGraphs:
    """The GDN prefill graphs (:mod:`clef_vllm.worker.fast.prefill_graphs`): single-sequence steps padded to
    ``buckets`` tokens; ``scope`` (:data:`PREFILL_GRAPH_SCOPES`) what a graph holds; with scope ``step``,
    steps of 2 to ``split`` sequences replay each one's step graph in turn (below 2: never)."""

    buckets: tuple[int, ...]
    scope: str = "core"
    split: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", tuple(int(b) for b in self.buckets))
        if any(b < 1 for b in self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
            raise SettingsError(f"prefill_graphs.buckets must be increasing positive token counts, got "
                                f"{list(self.buckets)}", "prefill_graphs")
        if self.scope not in PREFILL_GRAPH_SCOPES:
            raise SettingsError(f"prefill_graphs.scope must be one of {PREFILL_GRAPH_SCOPES}, got {self.scope!r}",
                                "prefill_graphs")
        _check_int("prefill_graphs.split", self.split, 0)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SettingsError(f"{name} must be an integer >= {minimum}, got {value!r}", name.split(".")[0])


@dataclass(frozen=True)
class WorkerSettings:
    """Everything the front-end tells the worker, scheduler and worker class of a Clef engine. The defaults are
    vLLM's own behaviour (every speed feature off); the backend's options turn features on
    (:mod:`clef_vllm.backends.engine_settings`)."""

    #: the joint head's dtype (:data:`HEAD_DTYPES`)
    head_dtype: str = "bfloat16"
    #: the GDN prefill graphs, or ``None``: off
    prefill_graphs: PrefillGraphs | None = None
    #: the joint head's CUDA graphs for steps finishing up to this many requests (:data:`HEAD_GRAPH_RECORDS`); 0: off
    head_graph_records: int = 0
    #: the state cache's side rows (with vLLM's prefix caching)
    state_cache: bool = False
    #: with the state cache on, its size in blocks instead of the computed one (tests)
    state_cache_blocks: int | None = None
    #: the head's GEMMs run over a grid of row counts at the first step, up to ``gemm_warmup_rows`` (``None``: a
    #: step's most)
    gemm_warmup: bool = False
    gemm_warmup_rows: int | None = None
    #: with the warm-up on, the head's eager GEMMs padded to the warm-up's row counts
    gemm_row_grid: bool = False
    #: the GDN metadata memo of single-prefill steps
    gdn_metadata_memo: bool = True
    #: the GDN prefill's Triton kernels tuned per shape class at the first forward
    gdn_tuning: bool = False
    #: how NVFP4 layers run (:data:`NVFP4_KERNELS`; ``vllm``: vLLM's own kernel)
    nvfp4_kernel: str = "vllm"
    #: data-parallel engines sharing each GPU
    engines_per_gpu: int = 1
    #: the scheduler's extra step that only drops finished requests once none is left
    idle_cleanup_step: bool = False
    #: milliseconds an idle engine may hold new requests to batch them (0: never)
    batch_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.head_dtype not in HEAD_DTYPES:
            raise SettingsError(f"head_dtype must be one of {HEAD_DTYPES}, got {self.head_dtype!r}", "head_dtype")
        if self.nvfp4_kernel not in NVFP4_KERNELS:
            raise SettingsError(f"nvfp4_kernel must be one of {NVFP4_KERNELS}, got {self.nvfp4_kernel!r}",
                                "nvfp4_kernel")
        if self.head_graph_records not in (0, *HEAD_GRAPH_RECORDS):
            raise SettingsError(f"head_graph_records must be 0 (off) or one of {HEAD_GRAPH_RECORDS}, got "
                                f"{self.head_graph_records!r}", "head_graph_records")
        for name in ("state_cache", "gemm_warmup", "gemm_row_grid", "gdn_metadata_memo", "gdn_tuning",
                     "idle_cleanup_step"):
            if not isinstance(getattr(self, name), bool):
                raise SettingsError(f"{name} must be true or false, got {getattr(self, name)!r}", name)
        _check_int("engines_per_gpu", self.engines_per_gpu, 1)
        for name in ("gemm_warmup_rows", "state_cache_blocks"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        wait = self.batch_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 1000:
            raise SettingsError(f"batch_wait_ms must be a number of milliseconds from 0 to 1000, got {wait!r}",
                                "batch_wait_ms")
        object.__setattr__(self, "batch_wait_ms", float(wait))
        if isinstance(self.prefill_graphs, dict):
            object.__setattr__(self, "prefill_graphs", PrefillGraphs(**self.prefill_graphs))
        if self.prefill_graphs is not None and not isinstance(self.prefill_graphs, PrefillGraphs):
            raise SettingsError(f"prefill_graphs must be PrefillGraphs or None, got {self.prefill_graphs!r}",
                                "prefill_graphs")

    @property
    def head_graphs(self) -> bool:
        return self.head_graph_records > 0

    @property
    def step_graphs(self) -> bool:
        """Whole-step graphs (prefill graphs of scope ``step``)."""
        return self.prefill_graphs is not None and self.prefill_graphs.scope == "step"

    def to_config(self) -> dict:
        """The engine's ``additional_config`` entries: the settings' plain (JSON) form under :data:`SETTINGS_KEY`."""
        plain = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.prefill_graphs is not None:
            plain["prefill_graphs"] = asdict(self.prefill_graphs) | {"buckets": list(self.prefill_graphs.buckets)}
        return {SETTINGS_KEY: plain}

    @classmethod
    def from_plain(cls, plain: dict) -> "WorkerSettings":
        """The settings from their plain form; :class:`SettingsError` naming an unknown key or a bad value."""
        if not isinstance(plain, dict):
            raise SettingsError(f"worker settings must be a mapping, got {type(plain).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(plain) - known)
        if unknown:
            raise SettingsError(f"unknown worker setting(s) {unknown} (this worker knows {sorted(known)}): the "
                                "front-end and the worker run different clef-vllm versions", unknown[0])
        values = dict(plain)
        graphs = values.get("prefill_graphs")
        if isinstance(graphs, dict):
            extra = sorted(set(graphs) - {"buckets", "scope", "split"})
            if extra:
                raise SettingsError(f"unknown prefill_graphs setting(s) {extra}", "prefill_graphs")
            values["prefill_graphs"] = PrefillGraphs(**graphs)
        return cls(**values)

    @classmethod
    def of(cls, vllm_config) -> "WorkerSettings":
        """The settings an engine was started with, from its ``VllmConfig`` (none given: the defaults, vLLM's own
        behaviour)."""
        plain = (getattr(vllm_config, "additional_config", None) or {}).get(SETTINGS_KEY)
        return cls() if plain is None else cls.from_plain(plain)


def with_settings(engine_kwargs: dict, **changes) -> WorkerSettings:
    """The worker settings in engine keywords (``vllm.AsyncEngineArgs``'s) with ``changes`` made, written back into
    them (checks and benchmarks that vary one setting of an engine built from options)."""
    config = engine_kwargs.setdefault("additional_config", {})
    settings = replace(WorkerSettings.from_plain(config.get(SETTINGS_KEY) or {}), **changes)
    config.update(settings.to_config())
    return settings

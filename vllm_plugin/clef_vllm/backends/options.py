"""Typed options of each backend, validated before any backend is built.

:func:`clef_vllm.backends.make_backend` turns its keyword arguments into :class:`ReferenceOptions` or
:class:`VllmOptions` with :func:`backend_options`: an unknown option, one that belongs to the other backend, or a
value of the wrong type or range is an :class:`OptionError` naming it. Nothing is dropped silently.

Each field is declared once, with :func:`option`: its default, help, ``clef-systemone`` flag(s) and how it
reaches ``vllm.AsyncEngineArgs`` (``engine=``); :func:`engine_args` and the server's flags are generated from
these declarations, so a new engine option is one new field of :class:`VllmOptions`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Callable

from clef_vllm.backends import engine_settings as E
from clef_vllm.contract import DEFAULT_NVFP4_KERNEL, DEFAULT_STEP_GRAPH_SPLIT, HEAD_GRAPH_RECORDS, NVFP4_KERNELS, PREFILL_GRAPH_SCOPES
from clef_vllm.schema.encoding import DEFAULT_MAX_LENGTH

#: ``dtype`` / ``head_dtype`` spellings accepted, by canonical name.
DTYPE_ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


class OptionError(ValueError):
    """An engine option that does not exist, does not apply to the chosen backend, or has a bad value.

    ``option`` names it; ``applies_to`` is the other backend when it is that backend's option only."""

    def __init__(self, message: str, option: str | None = None, applies_to: str | None = None):
        super().__init__(message)
        self.option = option
        self.applies_to = applies_to


def option(default: Any, help: str, *, flags: tuple[str, ...] = (), engine: str | Callable | None = None,
           kind: type | tuple[type, ...] | None = None, choices: tuple | None = None, minimum: float | None = None,
           maximum: float | None = None, action: str | None = None, metavar: str | None = None):
    """A dataclass field with what the CLI and the engine need to know about it.

    ``flags``: ``clef-systemone`` flags generated for it (none: the CLI maps it itself, or it has
    no flag). ``engine``: the ``AsyncEngineArgs`` keyword it sets (same value), or a function
    ``(options, kwargs) -> None`` that edits the engine kwargs, or ``None`` (options of ours; those the
    worker needs reach it through :func:`clef_vllm.backends.engine_settings.worker_settings`). ``kind``: the Python
    type(s) a value must have (``None`` is always allowed when the default is ``None``);
    ``choices`` / ``minimum`` / ``maximum`` restrict it further. ``action``: ``store_true`` or
    ``store_false`` for boolean flags; a boolean field without one takes ``on`` / ``off`` on the
    command line.
    """
    meta = {"help": help, "flags": flags, "engine": engine, "kind": kind, "choices": choices, "minimum": minimum,
            "maximum": maximum, "action": action, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


def _check(owner: str, f: dataclasses.Field, value: Any) -> Any:
    """Validate (and normalise) one value against its field's metadata."""
    m = f.metadata
    if value is None:
        if f.default is None:
            return None
        raise OptionError(f"{owner} option {f.name!r} must not be None", f.name)
    if f.name in ("dtype", "head_dtype") and not isinstance(value, str):   # e.g. torch.float32
        value = str(value)
    if f.name in ("dtype", "head_dtype"):
        value = DTYPE_ALIASES.get(value.removeprefix("torch."), value)
    kind = m.get("kind")
    if kind is not None:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not ok and float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            names = " or ".join(k.__name__ for k in kinds)
            raise OptionError(f"{owner} option {f.name!r} must be {names}, got {type(value).__name__} {value!r}",
                              f.name)
    choices = m.get("choices")
    if choices is not None and value not in choices:
        raise OptionError(f"{owner} option {f.name!r} must be one of {list(choices)}, got {value!r} ({m['help']})",
                          f.name)
    if m.get("minimum") is not None and value < m["minimum"]:
        raise OptionError(f"{owner} option {f.name!r} must be >= {m['minimum']}, got {value!r}", f.name)
    if m.get("maximum") is not None and value > m["maximum"]:
        raise OptionError(f"{owner} option {f.name!r} must be <= {m['maximum']}, got {value!r}", f.name)
    return value


class _Validated:
    """Checks every field against its :func:`option` metadata after ``__init__``, and refuses a sub-option
    given while its switch is off (:attr:`NEEDS_SWITCH`)."""

    backend: str = "?"
    #: Options that mean something only while a switch is on: another value with the switch off is an error.    NEEDS_SWITCH: dict[str, str] = {}

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _check(f"{self.backend} backend", f, getattr(self, f.name)))

    def _check_switches(self) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        for name, switch in self.NEEDS_SWITCH.items():
            if getattr(self, name) != defaults[name] and not getattr(self, switch):
                self._no_effect(name, f"{switch!r} off", f"turn {switch} on or leave {name} out")

    def _no_effect(self, name: str, condition: str, advice: str) -> None:
        """Refuse option ``name``: with ``condition`` its value would be silently ignored."""
        raise OptionError(f"{self.backend} backend option {name!r} ({getattr(self, name)!r}) has no effect with "
                          f"{condition}: {advice}", name)


@dataclass(frozen=True)
class ReferenceOptions(_Validated):
    """Options of the reference backend (transformers backbone + shared head, CPU or CUDA)."""

    backend = "reference"

    dtype: str = option("bfloat16", "dtype of the whole model, backbone and head (float32: the release's own "
                        "float32 numerics)", kind=(str,), choices=("bfloat16", "float32"))
    head_dtype: str | None = option(None, "the joint head's dtype when it differs from dtype (e.g. a float32 head on "
                                    "a bf16 backbone)", kind=(str,), choices=("bfloat16", "float32"))
    max_model_len: int = option(DEFAULT_MAX_LENGTH, "token limit per request", kind=int, minimum=1)
    text_only: bool = option(False, "serve text only: no vision tower; images get 400", kind=bool)
    device: str | None = option(None, "cpu or cuda (default: cuda if available)", flags=("--device",), kind=str)
    max_batch_size: int = option(16, "requests per micro-batch (default 16)", flags=("--max-batch-size",), kind=int,
                                 minimum=1)
    state_cache: bool = option(False, "reuse a state computed once: the backbone's cache (K/V, conv and recurrent "
                               "states) and hidden states at the end of each state (default off)", kind=bool)
    state_cache_mb: int = option(2048, "with the state cache on, the megabytes of kept states (least recently used "
                                 "go first; default 2048)", flags=("--reference-state-cache-mb",), kind=int, minimum=1)
    max_batch_tokens: int = option(32768, "padded tokens per micro-batch (at least max_model_len; default 32768)",
                                   flags=("--max-batch-tokens",), kind=int, minimum=1)
    threads: int | None = option(None, "on a CPU, torch's threads for the forward passes (default: OMP_NUM_THREADS when "
                                 "set, else every usable core but one)", flags=("--reference-threads",), kind=int, minimum=1)
    compute_nice: int = option(0, "on a CPU, how many nice steps below the server's other threads the forward passes' "
                               "thread and its OpenMP workers run (default 0: level with them)",
                               flags=("--reference-compute-nice",), kind=int, minimum=0, maximum=19)

    NEEDS_SWITCH = {"state_cache_mb": "state_cache"}

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_switches()

    @property
    def resolved_head_dtype(self) -> str:
        return self.head_dtype or self.dtype


def check_data_parallel(opts: "VllmOptions") -> None:
    """The data-parallel layouts this server runs (docs/deploy.md): one node; a head node with some of the
    ranks plus ``--headless`` nodes with the rest (``mp``); or every rank placed by Ray from the head node
    (``ray``). vLLM 0.28 refuses external load balancing (a front-end per rank) for a model without experts,
    and a head node given a start rank would balance its own engines only: neither is offered."""
    size, local, start = opts.data_parallel_size, opts.data_parallel_size_local, opts.data_parallel_start_rank
    if local is not None and local > size:
        raise OptionError(f"this node's ranks (--data-parallel-size-local {local}) cannot exceed --data-parallel-size ({size})",
                          "data_parallel_size_local")
    if opts.headless:
        if opts.data_parallel_backend == "ray":
            raise OptionError("a headless node starts its engines for an 'mp' head; with --data-parallel-backend "
                              "ray the head node places every rank itself: start only the head", "headless")
        if size < 2 or local is None or start is None:
            raise OptionError("a headless node needs --data-parallel-size (all ranks, > 1), --data-parallel-size-local "
                              "(this node's) and --data-parallel-start-rank (this node's first)", "headless")
        if start + local > size:
            raise OptionError(f"this node's ranks (--data-parallel-start-rank {start} + --data-parallel-size-local {local}) are more than "
                              f"--data-parallel-size {size} ranks", "data_parallel_start_rank")
        if opts.data_parallel_address is None:
            raise OptionError("a headless node needs --data-parallel-address: the head node's address", "headless")
        if opts.engine_core != "process":
            raise OptionError("a headless node runs engines in their own processes: leave --engine-core out",
                              "engine_core")
        return
    if start is not None:
        raise OptionError("a start rank is for --headless nodes: the head node holds ranks 0 to "
                          "--data-parallel-size-local - 1 (with a start rank vLLM would balance only its own engines)",
                          "data_parallel_start_rank")
    remote = local is not None and local < size
    if remote and opts.data_parallel_backend == "mp" and opts.data_parallel_address is None:
        raise OptionError(f"{local} of {size} ranks here (--data-parallel-size-local) leaves the rest to --headless nodes: give "
                          "--data-parallel-address, the address of this node they connect to",
                          "data_parallel_address")
    if not remote and opts.data_parallel_backend == "mp":
        for name in ("data_parallel_address", "data_parallel_rpc_port"):
            if getattr(opts, name) is not None:
                raise OptionError(f"no effect with every rank on this node: {flag_of(name)} is where "
                                  "--headless nodes connect (use --data-parallel-size-local to leave them ranks)",
                                  name)
    if opts.data_parallel_backend == "ray" and size < 2:
        raise OptionError("Ray places data-parallel ranks: give --data-parallel-size > 1",
                          "data_parallel_backend")


#: ``--gpu-memory-utilization``'s default for one engine on a GPU (vLLM's own)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

#: What each engine beyond a GPU's first leaves of the default share: the memory an engine takes beyond vLLM's
#: budget (the plugin's step and head graphs, the GEMM warm-up; measured ~5 GiB of an H200 at 9B, 3.6 %), so that
#: K engines with their overshoot still fit (two engines at 0.45 each left ~4 GiB free on an H200)
SHARED_GPU_HEADROOM = 0.05

#: ``--batch-wait-ms``'s default for one engine in its own process (measured: BF16 short decisions at c=16
#: 1.062x the req/s of no wait, c=64 1.001x; one request at a time never waits)
DEFAULT_BATCH_WAIT_MS = 2.0


#: ``--prefill-graph-buckets``: each a multiple of this (vLLM's capture sizes; Triton specialises on it), at most
#: :data:`MAX_BUCKET` (the step's token budget caps them further)
BUCKET_MULTIPLE, MAX_BUCKET = 16, 16384


def bucket_list(value: Any) -> tuple[int, ...]:
    """``--prefill-graph-buckets`` as sorted, distinct token counts: a comma list (``"64,128,448"``) or a
    sequence of ints. ValueError saying what is wrong."""
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        sizes = {int(str(x).strip()) for x in items if str(x).strip()}
    except ValueError:
        raise ValueError(f"expected token counts separated by commas, got {value!r}") from None
    if not sizes:
        raise ValueError("expected at least one token count")
    bad = sorted(n for n in sizes if n < BUCKET_MULTIPLE or n > MAX_BUCKET or n % BUCKET_MULTIPLE)
    if bad:
        raise ValueError(f"each bucket must be a multiple of {BUCKET_MULTIPLE} from {BUCKET_MULTIPLE} to "
                         f"{MAX_BUCKET}, got {bad}")
    return tuple(sorted(sizes))


def on_off(text: str) -> bool:
    """``on`` / ``off`` as a flag's value (argparse type)."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


@dataclass(frozen=True)
class VllmOptions(_Validated):
    """Options of the vLLM backend. Every field that reaches the engine says how (``engine=``).

    Engine settings that are not up to the user are in
    :data:`clef_vllm.backends.vllm_backend.FIXED_ENGINE_SETTINGS`.
    """

    backend = "vllm"

    dtype: str = option("bfloat16", "dtype of the backbone: vLLM runs Clef in bfloat16; for a float32 head use "
                        "head_dtype (--head-dtype)", engine="dtype", kind=(str,), choices=("bfloat16",))
    head_dtype: str | None = option(None, "the joint head's dtype inside the worker (bfloat16 or float32)",
                                    kind=(str,), choices=("bfloat16", "float32"))
    text_only: bool = option(False, "serve text only: no vision tower; images get 400", kind=bool)
    largest_image_pixels: int | None = option(None, "largest image (width x height) the engine takes, 413 beyond "
                                              "(--max-image-pixels; default the processor's, or the memory plan's)",
                                              kind=int, minimum=1024)
    max_model_len: int = option(DEFAULT_MAX_LENGTH, "token limit per request", engine="max_model_len", kind=int,
                                minimum=1)
    data_parallel_size: int = option(1, "engines, one per GPU, behind this one port (internal load balancing)",
                                     flags=("--data-parallel-size", "--dp", "-dp"), engine="data_parallel_size", kind=int,
                                     minimum=1)
    data_parallel_size_local: int | None = option(None, "of --data-parallel-size's engines, how many run on this "
                                                  "node (default: all; fewer on the head node of a multi-node "
                                                  "deployment, whose other ranks are --headless nodes; "
                                                  "docs/deploy.md)", flags=("--data-parallel-size-local", "-dpl"),
                                                  engine="data_parallel_size_local", kind=int, minimum=1)
    data_parallel_address: str | None = option(None, "the head node's address that --headless ranks connect to "
                                               "(multi-node data parallelism; docs/deploy.md)",
                                               flags=("--data-parallel-address", "-dpa"),
                                               engine="data_parallel_address", kind=str)
    data_parallel_rpc_port: int | None = option(None, "the head node's port for that handshake (default vLLM's, "
                                                "13345)", flags=("--data-parallel-rpc-port", "-dpp"),
                                                engine="data_parallel_rpc_port", kind=int, minimum=1, maximum=65535)
    data_parallel_start_rank: int | None = option(None, "with --headless: the data-parallel rank of this node's "
                                                  "first engine", flags=("--data-parallel-start-rank", "-dpr"),
                                                  engine="data_parallel_start_rank", kind=int, minimum=1)
    data_parallel_backend: str = option("mp", "how the head starts data-parallel engines: 'mp' (processes on this "
                                        "node; remote ranks are --headless nodes) or 'ray' (Ray actors placed on "
                                        "a Ray cluster's GPUs from the head node alone; needs ray)",
                                        flags=("--data-parallel-backend", "-dpb"), engine=E.data_parallel_backend,
                                        kind=str, choices=("mp", "ray"))
    headless: bool = option(False, "start this node's data-parallel engines only, no HTTP server: they join the "
                            "head node at --data-parallel-address (docs/deploy.md)", flags=("--headless",),
                            kind=bool, action="store_true")
    rank_watchdog_s: float = option(5.0, "on a head node with --headless ranks: seconds between liveness probes "
                                    "of each remote rank; one that leaves 3 in a row unanswered (deadline twice "
                                    "this) is dead: the server answers 503 and exits 1 (default 5; 0: off; "
                                    "docs/deploy.md)", flags=("--rank-watchdog-s",), kind=float, minimum=0.0,
                                    metavar="S")
    engines_per_gpu: int = option(1, "data-parallel engines per GPU: --dp counts engines, placed this many on each "
                                  "GPU in order (default 1); they start one after another, each with its share of "
                                  "the memory. For data parallelism on fewer GPUs, not for speed: measured slower "
                                  "than one engine (docs/operating.md)", flags=("--engines-per-gpu",),
                                  engine=E.engines_per_gpu, kind=int, minimum=1)
    gpu_memory_utilization: float | None = option(None, "share of a GPU's memory each engine may use (default 0.9; with "
                                                  "--engines-per-gpu K, (0.9 - 0.05 (K-1)) / K)",
                                                  flags=("--gpu-memory-utilization",), engine=E.gpu_memory,
                                                  kind=float, minimum=0.01, maximum=1.0)
    max_num_seqs: int = option(128, "requests per engine step (default 128)", flags=("--max-num-seqs",),
                               engine="max_num_seqs", kind=int, minimum=1)
    max_num_batched_tokens: int | None = option(None, "tokens per engine step; longer prompts are chunked (default: "
                                                "max-model-len clamped to [8192, 16384])",
                                                flags=("--max-num-batched-tokens",), engine=E.max_num_batched_tokens,
                                                kind=int, minimum=1)
    enforce_eager: bool = option(False, "no CUDA graphs / torch.compile (faster start, slower steps)",
                                 flags=("--enforce-eager",), engine="enforce_eager", kind=bool, action="store_true")
    gdn_prefill_backend: str | None = option("triton", "GDN prefill kernel (default triton: FlashInfer's JITs on "
                                             "first use on Hopper and runs without the prefill graphs and the "
                                             "GDN tuning; docs/latency.md)",
                                             flags=("--gdn-prefill-backend", "--gdn-backend"),
                                             engine="gdn_prefill_backend", kind=str,
                                             choices=("triton", "flashinfer", "cutedsl"))
    linear_backend: str | None = option(None, "vLLM --linear-backend (e.g. emulation: true W4A4 NVFP4 numerics on "
                                        "Hopper, slow)", flags=("--linear-backend",), engine="linear_backend",
                                        kind=str)
    nvfp4_kernel: str = option(DEFAULT_NVFP4_KERNEL,
                               "how a checkpoint's NVFP4 W4A4 layers run: 'auto' (default: bf16 where vLLM's kernel "
                               "would be Marlin, before Blackwell; vllm from Blackwell on), 'vllm' (vLLM's kernel: "
                               "Marlin W4A16 before Blackwell, native W4A4 from it; the least memory) or 'bf16' "
                               "(weights dequantized to BF16 once at load, BF16 GEMMs: Marlin's W4A16 numerics without "
                               "its cost at prefill sizes, 3.6x the weights' memory; docs/latency.md)",
                               flags=("--nvfp4-kernel",), kind=str, choices=NVFP4_KERNELS)
    quantization: str | None = option(None, "online quantization of a BF16 checkpoint (e.g. fp8); quantized "
                                      "checkpoints need none", flags=("--quantization",), engine="quantization",
                                      kind=str)
    load_format: str = option("auto", "vLLM load format; 'dummy' = random weights for benchmarks (configs only); "
                              "'clef-dummy' = the same with a quantized checkpoint's scales set to tame constants "
                              "(docs/bench.md)",
                              flags=("--load-format",), engine="load_format", kind=str)
    seed: int = option(0, "engine seed", engine="seed", kind=int)
    prefill_graphs: bool = option(True, "replay the GDN layers of single-sequence prefill steps from CUDA graphs and "
                                  "capture vLLM's piecewise graphs up to the same token counts (default on; "
                                  "docs/latency.md)", flags=("--prefill-graphs",), engine=E.prefill_graphs, kind=bool)
    prefill_graph_scope: str = option("auto", "what a prefill graph holds: 'core' (the GDN core), 'layer' (also "
                                      "vLLM's split of the projections and the gated norm), 'step' (the core "
                                      "graphs, and the whole backbone of a single-sequence step in one graph) or "
                                      "'auto' (default: step, or core where step cannot run: a GDN backend other "
                                      "than Triton, --enforce-eager); layer is experimental (docs/latency.md)",
                                      flags=("--prefill-graph-scope",), kind=str,
                                      choices=("auto", *PREFILL_GRAPH_SCOPES))
    prefill_graph_buckets: tuple[int, ...] | None = option(
        None, "the token counts a single-sequence prefill step is padded to for its graphs, a comma list of "
        "multiples of 16 (default: every 64 up to 512, then 640, 768, 1024, 1280, 1536, 2048, 3072, 4096; "
        "with a BF16 backbone also 400, with online FP8 480 instead of 384 and 448: sizes where the "
        "H200's GEMMs are cheap); finer buckets pad less and capture more graphs at start (docs/latency.md)",
        flags=("--prefill-graph-buckets",), kind=(str, tuple, list), metavar="N,N,...")
    step_graph_split: int = option(DEFAULT_STEP_GRAPH_SPLIT,
                                   "with whole-step graphs, a step of 2 to N prefill sequences (2,048 tokens at "
                                   "most) replays each sequence's step graph in turn instead of running vLLM's "
                                   "eager path, whose launches outlast the GPU's work for a few short requests "
                                   f"(default {DEFAULT_STEP_GRAPH_SPLIT}; 0 or 1: never; docs/latency.md)",
                                   flags=("--step-graph-split",), kind=int, minimum=0, maximum=64, metavar="N")
    gdn_metadata_memo: bool = option(True, "answer a single-sequence prefill step of a length seen before with "
                                     "the GDN attention metadata built then (its state indices this step's; "
                                     "default on; docs/latency.md)", flags=("--gdn-metadata-memo",),
                                     kind=bool)
    gdn_tuning: bool = option(True, "at start-up, autotune the GDN prefill's Triton kernels for one short "
                              "sequence, one long one and a batch of sequences, and run each step with its "
                              "class's choice (vLLM tunes them once, at 64 tokens, for every step; default on: "
                              "~7 s with Triton's compile cache warm, about a minute on a fresh machine, mostly "
                              "compiling what vLLM's warm-up would compile; docs/latency.md)", flags=("--gdn-tuning",),
                              kind=bool)
    head_graphs: bool = option(True, "run the joint head of a step that finishes up to --head-graph-records "
                               "requests from a CUDA graph (default on; docs/latency.md)", flags=("--head-graphs",),
                               kind=bool)
    head_graph_records: int = option(16, "with the head graphs on, graph steps that finish up to this many requests "
                                     "(1, 2, 4, 8, 16, 32 or 64; default 16; docs/latency.md)",
                                     flags=("--head-graph-records",), kind=int, choices=HEAD_GRAPH_RECORDS)
    gemm_warmup: bool = option(True, "at the first step, run the joint head's GEMM shapes over a grid of row counts "
                               "so CUDA loads their kernels then, not mid-step later, when a first-time kernel "
                               "waits for the GPU to drain (default on: about half a second once; "
                               "docs/latency.md)",
                               flags=("--gemm-warmup",), kind=bool)
    gemm_warmup_rows: int | None = option(None, "with the GEMM warm-up on, the most rows it runs the head's GEMMs at "
                                          "(default: a step's most, max(max_num_batched_tokens, max_model_len); the "
                                          "memory plan lowers it where the warm-up's transient memory would crowd the "
                                          "KV cache)", kind=int, minimum=1)
    gemm_row_grid: bool = option(True, "with the GEMM warm-up on, run the head's GEMMs outside its graphs (the "
                                 "per-token stage, steps the head graphs do not take) at the warm-up's row counts: "
                                 "rows padded up to the next one (at most 1/8 more), so none meets a kernel CUDA "
                                 "has not loaded (default on; docs/latency.md)",
                                 flags=("--gemm-row-grid",), kind=bool)
    state_cache: bool = option(True, "reuse a state computed once (vLLM: prefix caching plus the head's memory rows "
                               "of cached prefixes, default on; reference: the backbone's cache at the end of "
                               "each state, default off: the reference is the exact one; docs/state-cache.md)",
                               flags=("--state-cache",), engine=E.state_cache, kind=bool)
    state_cache_admit: str = option("repeat", "with the state cache on, which states are kept: 'repeat' (a state "
                                    "seen before or in flight; a state's first request runs in one step and "
                                    "is not cached) or 'first' (every state long enough)",
                                    flags=("--state-cache-admit",), kind=str, choices=("repeat", "first"))
    state_cache_match: str = option("unit", "with the state cache on, where a hit may end: 'unit' (at the end of "
                                    "the request's state and schema header, to 16 tokens: vLLM's prefix-match "
                                    "unit) or 'block' (at the last whole KV block in it, 528 tokens at 9B)",
                                    flags=("--state-cache-match",), kind=str,
                                    choices=("unit", "block"))
    engine_core: str = option("process", "where vLLM's engine core runs: 'process' (its own, as AsyncLLM runs it; "
                              "default) or 'thread' (a thread of the server's process: no trip between processes "
                              "per request, one interpreter lock for both: one decision in 0.92x the time, "
                              "0.85-0.88x the req/s at c=16/64; one engine only; docs/latency.md)",
                              flags=("--engine-core",), kind=str, choices=("process", "thread"))
    async_scheduling: bool = option(False, "schedule and prepare the next engine step while the GPU runs the "
                                    "current one (vLLM's async scheduling; default off, as vLLM's for pooling "
                                    "models; docs/latency.md)", flags=("--async-scheduling",), engine=E.scheduling,
                                    kind=bool)
    idle_cleanup_step: bool = option(False, "when the last request finishes, step the engine once more only to "
                                     "drop it from the workers, as vLLM does (default off: the next step that "
                                     "schedules work drops it; docs/latency.md)", flags=("--idle-cleanup-step",),
                                     kind=bool)
    batch_wait_ms: float | None = option(None, "while nothing runs and fewer requests wait than half the largest "
                                         "step of the last second, hold them up to this many milliseconds to "
                                         "batch them (default 2 with one engine in its own process, else 0: "
                                         "never; docs/latency.md)",
                                         flags=("--batch-wait-ms",), kind=float, minimum=0.0,
                                         maximum=50.0, metavar="MS")
    warmup: bool = option(True, "skip the start-up warm-up (first requests will be slow)", flags=("--no-warmup",),
                          kind=bool, action="store_false")

    NEEDS_SWITCH = {"prefill_graph_scope": "prefill_graphs", "prefill_graph_buckets": "prefill_graphs",
                    "step_graph_split": "prefill_graphs",
                    "head_graph_records": "head_graphs",
                    "gemm_row_grid": "gemm_warmup",
                    "gemm_warmup_rows": "gemm_warmup",
                    "state_cache_admit": "state_cache",
                    "state_cache_match": "state_cache"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefill_graph_buckets is not None:
            try:
                object.__setattr__(self, "prefill_graph_buckets", bucket_list(self.prefill_graph_buckets))
            except ValueError as exc:
                raise OptionError(f"vllm backend option 'prefill_graph_buckets': {exc}", "prefill_graph_buckets") from None
        self._check_switches()
        if self.prefill_graph_scope in ("layer", "step") and self.gdn_prefill_backend != "triton":
            # the prefill graphs hold vLLM's Triton GDN kernels; other backends take vLLM's path
            self._no_effect("prefill_graph_scope", f"'gdn_prefill_backend' {self.gdn_prefill_backend!r} (the prefill "
                            "graphs hold the Triton GDN kernels)", "use --gdn-prefill-backend triton or leave the "
                            "scope out")
        if self.nvfp4_kernel == "bf16" and self.linear_backend_chosen:
            raise OptionError(f"vllm backend option 'nvfp4_kernel' {self.nvfp4_kernel!r} chooses the NVFP4 kernel "
                              f"itself: leave linear_backend ({self.linear_backend!r}) out or nvfp4_kernel at 'vllm'",
                              "nvfp4_kernel")
        if self.engine_core == "thread" and self.data_parallel_size > 1:
            # data-parallel engines each need their own process (vLLM's DP coordinator)
            raise OptionError("vllm backend option 'engine_core' 'thread' runs one engine: leave data_parallel_size "
                              "at 1 or use 'process'", "engine_core")
        check_data_parallel(self)
        if self.engines_per_gpu > self.data_parallel_size:
            raise OptionError(f"vllm backend option 'engines_per_gpu' ({self.engines_per_gpu}) places data-parallel "
                              f"engines: it cannot exceed data_parallel_size ({self.data_parallel_size})",
                              "engines_per_gpu")
        if self.engines_per_gpu * self.resolved_gpu_memory_utilization > 1.0:
            raise OptionError(f"vllm backend option 'gpu_memory_utilization' is each engine's share of its GPU: "
                              f"{self.engines_per_gpu} engines x {self.gpu_memory_utilization} is more than the "
                              f"whole GPU (at most {1.0 / self.engines_per_gpu:.2f}, or leave it out)",
                              "gpu_memory_utilization")
        if self.batch_wait_ms and not self.one_engine_process:
            raise OptionError("vllm backend option 'batch_wait_ms' is for one engine in its own process: leave "
                              "data_parallel_size at 1 and engine_core 'process', or the wait at 0", "batch_wait_ms")
        if self.step_graph_split != DEFAULT_STEP_GRAPH_SPLIT and self.prefill_graphs \
                and self.resolved_prefill_graph_scope != "step":
            # the split replays whole-step graphs, which only scope step captures
            self._no_effect("step_graph_split", f"prefill graph scope {self.resolved_prefill_graph_scope!r} (it "
                            "replays whole-step graphs)", "use --prefill-graph-scope step or auto, or leave the "
                            "split out")
        if self.prefill_graph_scope == "step" and self.enforce_eager:
            # the step graphs replay only steps vLLM runs in its piecewise CUDA-graph mode
            self._no_effect("prefill_graph_scope", "'enforce_eager' on (no piecewise CUDA graphs, so no step "
                            "qualifies)", "use 'core' or leave enforce_eager out")

    @property
    def resolved_gpu_memory_utilization(self) -> float:
        """Each engine's share of its GPU's memory: as given, else :data:`DEFAULT_GPU_MEMORY_UTILIZATION` split
        between the engines that share the GPU, less :data:`SHARED_GPU_HEADROOM` for each engine after the first."""
        if self.gpu_memory_utilization is not None:
            return float(self.gpu_memory_utilization)
        k = self.engines_per_gpu
        return round((DEFAULT_GPU_MEMORY_UTILIZATION - SHARED_GPU_HEADROOM * (k - 1)) / k, 4)

    @property
    def resolved_head_dtype(self) -> str:
        return self.head_dtype or self.dtype

    @property
    def linear_backend_chosen(self) -> bool:
        """A ``--linear-backend`` other than vLLM's own choice: it filters vLLM's kernel lists down to its
        kernels, so the plugin's NVFP4 kernel cannot be put first (``bf16`` is refused, ``auto`` yields)."""
        return self.linear_backend not in (None, "auto")

    @property
    def one_engine_process(self) -> bool:
        """One engine in its own process: the only kind that can idle through the scheduler's batch wait (its
        empty steps: vLLM's DP loop answers them with dummy batches on the GPU, and the engine thread steps
        again at once, with no idle sleep, so it would spin)."""
        return self.data_parallel_size == 1 and self.engine_core == "process"

    @property
    def resolved_batch_wait_ms(self) -> float:
        """The scheduler's batch wait: as given, else DEFAULT_BATCH_WAIT_MS for :attr:`one_engine_process`
        and none otherwise."""
        if self.batch_wait_ms is not None:
            return float(self.batch_wait_ms)
        return DEFAULT_BATCH_WAIT_MS if self.one_engine_process else 0.0

    @property
    def resolved_prefill_graph_scope(self) -> str:
        """The scope the worker runs: ``auto`` is ``step`` where step graphs can run (the Triton GDN backend,
        vLLM's piecewise graphs), else ``core``."""
        if self.prefill_graph_scope != "auto":
            return self.prefill_graph_scope
        return "step" if self.gdn_prefill_backend == "triton" and not self.enforce_eager else "core"


#: Option dataclass per backend name.
OPTIONS: dict[str, type] = {"reference": ReferenceOptions, "vllm": VllmOptions}


def field_names(backend: str) -> set[str]:
    return {f.name for f in fields(OPTIONS[backend])}


def backend_options(backend: str, options: dict[str, Any]):
    """``options`` as the typed options of ``backend`` (``reference`` or ``vllm``).

    A ``None`` value means "the default". Raises :class:`OptionError` naming the first option that
    is unknown, belongs to the other backend only, or has a bad value.
    """
    if backend not in OPTIONS:
        raise OptionError(f"no options for backend {backend!r}; expected one of {sorted(OPTIONS)}")
    given = {k: v for k, v in options.items() if v is not None}
    mine = field_names(backend)
    for name in given:
        if name in mine:
            continue
        others = [b for b in OPTIONS if b != backend and name in field_names(b)]
        if others:
            raise OptionError(f"option {name!r} applies to the {others[0]} backend, not to the {backend} backend",
                              name, others[0])
        raise OptionError(f"unknown option {name!r} for the {backend} backend; it takes {sorted(mine)}", name)
    return OPTIONS[backend](**given)


def engine_args(opts: VllmOptions) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` keywords that :class:`VllmOptions` fields produce (see their ``engine``), and the
    workers' :class:`~clef_vllm.contract.WorkerSettings` in ``additional_config``."""
    kwargs: dict[str, Any] = {}
    for f in fields(opts):
        how = f.metadata.get("engine")
        if how is None:
            continue
        if callable(how):
            how(opts, kwargs)
        elif getattr(opts, f.name) is not None:
            kwargs[how] = getattr(opts, f.name)
    settings = E.worker_settings(opts, kwargs["max_num_batched_tokens"])
    kwargs.setdefault("additional_config", {}).update(settings.to_config())
    return kwargs


# --------------------------------------------------------------------------- command-line flags


def add_flags(group, backend: str) -> None:
    """Add the flags of ``backend``'s options that declare ``flags`` to an argparse group, or to the group
    ``group(name)`` returns for option ``name`` when ``group`` is callable.

    Defaults are suppressed: a flag that was not given does not appear in the namespace, so
    :func:`given_options` can tell "given" from "default" (a flag given for the other backend is
    then an error, not silently ignored)."""
    for f in fields(OPTIONS[backend]):
        m = f.metadata
        if not m.get("flags"):
            continue
        target = group(f.name) if callable(group) else group
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": m["help"]}
        if m.get("action"):
            kw["action"] = m["action"]
        elif m["kind"] is bool:
            kw.update(type=on_off, metavar="{on,off}")
        else:
            kinds = m["kind"] if isinstance(m["kind"], tuple) else (m["kind"],)
            kw["type"] = kinds[0] if kinds[0] in (int, float) else str
            if m.get("choices"):
                kw["choices"] = list(m["choices"])
            if m.get("metavar"):
                kw["metavar"] = m["metavar"]
        target.add_argument(*m["flags"], **kw)


def flag_of(name: str) -> str:
    """The CLI flag of option ``name`` (for messages): its first declared flag, else ``--name``."""
    for cls in OPTIONS.values():
        for f in fields(cls):
            if f.name == name and f.metadata.get("flags"):
                return f.metadata["flags"][0]
    return "--" + name.replace("_", "-")


def given_options(namespace: argparse.Namespace) -> dict[str, Any]:
    """The backend options present in a namespace built with :func:`add_flags` (flags given)."""
    names = set().union(*(field_names(b) for b in OPTIONS))
    return {k: v for k, v in vars(namespace).items() if k in names}

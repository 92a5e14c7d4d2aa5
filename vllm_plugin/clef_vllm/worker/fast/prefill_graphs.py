"""Plugin-owned CUDA graphs for the Gated DeltaNet layers of prefill steps.

Why: vLLM 0.28 runs a pooling model's linear layers as piecewise CUDA graphs, but every GDN
layer is a graph break. Its core (causal conv1d, gating prep, the chunked delta rule, the state
write) is ~8 Triton launches whose host cost (~0.9 ms per layer, mostly Python and Triton's
launch path) dwarfs their GPU time for a short request: 24 layers make a ~400-token decision
host-bound. Replaying the same kernels from a CUDA graph costs one launch.

What: for a step that prefills exactly ONE sequence (the common case for an interactive
decision, and every chunk of a long one), each GDN layer's core runs from a graph captured for
a padded token count (a *bucket*). Every other step takes vLLM's own path unchanged.

Padding is made exact, not approximate:

* causal conv1d and the delta rule are causal, so outputs of the real rows never see the
  padded rows after them;
* padded rows get gate ``g = 0`` (decay ``exp(0) = 1``) and ``beta = 0`` (no write), so the
  recurrent state after the padded rows equals the state after the last real row, bit for bit
  (the WY factors of a ``beta = 0`` row are zero rows). Their gate inputs ``a`` and ``b`` are
  ``-inf``: the gating prep computes ``g = -exp(A_log) * softplus(a + dt_bias)`` and
  ``beta = sigmoid(b)``, and ``softplus(-inf) = 0``, ``sigmoid(-inf) = 0`` exactly (vLLM's fused
  post-conv kernel selects ``log(1 + exp(x))`` for ``x <= 0``), the same bits a mask multiply gave,
  without two kernels per layer;
* the conv state the kernel stores (the last ``width - 1`` inputs of the *padded* sequence) is
  replaced by the last ``width - 1`` real inputs.

So the states written for the sequence are those of the real tokens and may be read again
(a later chunk of the same prompt, or a prefix-cache hit). Static buffers are shared by all
layers of a bucket (layers run one after another on one stream); graphs share one memory pool.
Capture uses the null block's state line (line 0) as scratch, so it never touches a request's
state. See docs/latency.md.

Two scopes (``--prefill-graph-scope``): ``core`` wraps the GDN core (conv, prep, delta rule, state
writes); ``layer`` wraps vLLM's packed GDN op one level higher, so the split of the projections, the
``b``/``a`` copies and the gated RMS norm replay inside the graph too (two input copies instead of
three, and no Triton launch through Python for the norm). Steps ``layer`` cannot take fall back to
``core``, then to vLLM's path.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from clef_vllm.util import trace
from clef_vllm.worker import memory

log = logging.getLogger("clef_vllm")

#: Padded token counts a single-sequence prefill step can replay from a graph. A step with more
#: tokens (or several sequences) runs vLLM's own path.
DEFAULT_BUCKETS = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096)
#: The buckets per linear-layer kernel where the backbone's GEMMs make a different size cheaper (the H200's
#: GEMM sweeps, ``bench/results/h200_gemm_sizes_{bf16,fp8}.json``, each length padded to its cheapest bucket, and
#: paired against DEFAULT_BUCKETS at c=1: 0.969x and 0.975x the p50). Unquantized BF16 (cuBLAS: 9.2 ms of
#: GEMMs at 400 rows, 10.5 at 448) adds 400. Online FP8 (vLLM's cutlass kernel) pads 321-480 tokens to 480:
#: its whole step at 480 tokens took 15.7 ms, at 368-464 tokens 16.5-18.3 ms
#: (``bench/results/h200_latency_9b_fp8_sweep368-528.json``), and one short decision 0.973x the p50 of the
#: previous list (384, 464 instead of 448), paired.
LINEAR_BUCKETS = {"bf16": tuple(sorted({*DEFAULT_BUCKETS, 400})),
                  "fp8": tuple(sorted(set(DEFAULT_BUCKETS) - {384, 448} | {480}))}
#: FLA's chunk length: chunk metadata is built per bucket for this size.
CHUNK_SIZE = 64
#: The null block's state line: scratch for warm-up and capture (vLLM pads with it too).
SCRATCH_LINE = 0
#: What a graph holds: the GDN core, or the whole packed GDN op (split + core + gated norm).
SCOPES = ("core", "layer")
#: The bucket buffers that hold gate inputs (``a``, ``b``, packed ``ba``): -inf in padded rows.
GATE_INPUTS = frozenset({"a", "b", "ba"})


def default_buckets(linear: str | None) -> tuple[int, ...]:
    """The default buckets of a backbone whose linear layers run ``linear``: ``None`` for unquantized BF16,
    else vLLM's quantization method (``"fp8"`` online). Other methods, a quantized checkpoint's own among
    them, keep DEFAULT_BUCKETS: their kernels were not swept."""
    return LINEAR_BUCKETS.get(linear or "bf16", DEFAULT_BUCKETS)


def choose_bucket(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest of the sorted ``buckets`` holding ``value`` (here tokens; the head graphs' memory
    rows and records too), or ``None`` when none does."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


def prefill_reason(md: Any, sequences: int | None = None) -> str | None:
    """Why a step's GDN metadata is not a plain prefill step (``None``: it is): speculative tokens, decodes,
    not ``sequences`` prefills (``"batch"`` for more; ``None``: any number), padded metadata, or not one state
    line per prefill. Host-side fields only. Single-sequence graphs ask for one sequence, the step graphs'
    split of a small batch (``clef_vllm.worker.fast.step_graphs``) for any."""
    if getattr(md, "spec_sequence_masks", None) is not None or getattr(md, "num_spec_decodes", 0):
        return "speculative"
    if md.num_decodes:
        return "decodes"
    if sequences is not None and md.num_prefills != sequences:
        return "batch" if md.num_prefills > sequences else "no_prefill"
    if md.num_prefill_tokens != md.num_actual_tokens:
        return "padded_metadata"
    if md.prefill_state_indices is None or md.prefill_state_indices.shape[0] != md.num_prefills:
        return "state_indices"
    return None


def fallback_reason(md: Any, buckets: Sequence[int], min_tokens: int) -> str | None:
    """Why a step's GDN metadata cannot use a graph (``None``: it can).

    Eligible: exactly one prefill sequence, no decodes, no speculative tokens, at least
    ``min_tokens`` tokens (the conv state repair needs ``width - 1`` real rows) and a bucket that
    holds them. Only host-side fields are read: no GPU synchronisation.
    """
    if md is None:
        return "no_metadata"
    reason = prefill_reason(md, sequences=1)
    if reason is not None:
        return reason
    n = md.num_actual_tokens
    if n < min_tokens:
        return "too_short"
    if choose_bucket(n, buckets) is None:
        return "too_long"
    return None


# --------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class GdnKernels:
    """The kernels a GDN core is made of; vLLM's Triton kernels on the GPU, a torch reference in tests.

    ``conv(x, layer, has_init, lines, query_start_loc, meta)``: causal conv1d + activation of
    ``x`` [dim, T] (channel-last view), reading and updating ``layer.conv_state`` lines.
    ``prep(y, a, b, layer)``: (q, k, v, g, beta) from the conv output [T, dim] (g: log decay).
    ``rule(q, k, v, g, beta, h0, cu_seqlens, chunk_indices, chunk_offsets)``: (o, final_state).
    ``split(qkvz, ba, layer)`` (scope ``layer``): (mixed_qkv, gate [T, heads, dv], b, a) of the packed
    projections. ``norm(x, gate, out, layer)`` (scope ``layer``): the gated RMS norm; ``out`` may be ``x``.
    """

    conv: Callable
    prep: Callable
    rule: Callable
    split: Callable | None = None
    norm: Callable | None = None


def vllm_kernels() -> GdnKernels:
    """vLLM 0.28's own Triton kernels, called exactly as its ``_forward_core`` prefill path does."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
    from vllm.third_party.flash_linear_attention.ops import fused_post_conv_prep

    def conv(x, layer, has_init, lines, query_start_loc, meta):
        return causal_conv1d_fn(x, layer.conv_weight, layer.conv_bias, activation=layer.activation,
                                conv_states=layer.conv_state, has_initial_state=has_init, cache_indices=lines,
                                query_start_loc=query_start_loc, metadata=meta)

    def prep(y, a, b, layer):
        return fused_post_conv_prep(conv_output=y, a=a, b=b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                                    num_k_heads=layer.num_k_heads, head_k_dim=layer.head_k_dim,
                                    head_v_dim=layer.head_v_dim, apply_l2norm=True, output_g_exp=False)

    def rule(q, k, v, g, beta, h0, cu_seqlens, chunk_indices, chunk_offsets, *, layer):
        return layer.chunk_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                                use_qk_l2norm_in_kernel=False)

    def split(qkvz, ba, layer):   # as vLLM's _forward_core_fused_norm_packed and _forward_core_fused_norm
        mixed_qkv, gate_flat = qkvz.split([layer.qkv_size, layer.value_size], dim=-1)
        b, a = layer.split_ba(ba)
        return mixed_qkv, gate_flat.reshape(gate_flat.size(0), -1, layer.head_v_dim), b.contiguous(), a.contiguous()

    def norm(x, gate, out, layer):
        layer.rms_norm_gated(x, gate, out)

    return GdnKernels(conv=conv, prep=prep, rule=rule, split=split, norm=norm)


# --------------------------------------------------------------------------- buffers


class Bucket:
    """Static buffers and chunk metadata for one padded length, shared by every GDN layer."""

    def __init__(self, size: int, dims: "GdnDims", device, dtype, conv_meta: Any, chunk_indices, chunk_offsets):
        self.size = size
        zeros = dict(device=device)
        # ``qkv`` starts as zeros: its padded rows then only ever hold earlier real (finite) inputs. The
        # gate inputs ``a`` and ``b`` start as -inf and :meth:`set_length` keeps their padded rows so:
        # a padded row's gate is then g = 0 and beta = 0 (the module docstring).
        self.qkv = torch.zeros(size, dims.conv_dim, dtype=dtype, **zeros)
        self.b = torch.full((size, dims.num_v_heads), float("-inf"), dtype=dtype, **zeros)
        self.a = torch.full((size, dims.num_v_heads), float("-inf"), dtype=dtype, **zeros)
        self.out = torch.zeros(size, dims.num_v_heads, dims.head_v_dim, dtype=dtype, **zeros)
        self.lines = torch.zeros(1, dtype=torch.int32, **zeros)          # the sequence's state line
        self.has_init = torch.zeros(1, dtype=torch.bool, **zeros)        # read its state first?
        self.query_start_loc = torch.tensor([0, size], dtype=torch.int32, **zeros)
        self.real = torch.zeros(size, 1, dtype=torch.bool, **zeros)      # True for real rows, False for padding
        self.zero = torch.zeros((), dtype=dtype, **zeros)                 # what a padded row selects
        self.minus_inf = torch.full((), float("-inf"), dtype=dtype, **zeros)   # ... of a gate input
        self.positions = torch.arange(size, dtype=torch.int64, **zeros)
        self.tail_offsets = torch.arange(-(dims.conv_width - 1), 0, dtype=torch.int64, **zeros)
        self.tail = torch.zeros(dims.conv_width - 1, dtype=torch.int64, **zeros)
        self.conv_meta = conv_meta
        self.chunk_indices = chunk_indices
        self.chunk_offsets = chunk_offsets
        self.length: int | None = None
        # The (forward context, GDN metadata) whose state line and initial-state flag ``lines`` and
        # ``has_init`` hold: copied once per step and KV-cache group, not once per layer.
        self.fed: tuple[Any, Any] | None = None
        self.qkvz: torch.Tensor | None = None      # scope "layer": the packed projections
        self.ba: torch.Tensor | None = None

    def packed(self, qkvz_dim: int, ba_dim: int) -> "Bucket":
        """Allocate the packed-input buffers of scope ``layer`` (once; ``ba`` holds gate inputs: -inf, like
        ``a`` and ``b``)."""
        if self.qkvz is None:
            self.qkvz = torch.zeros(self.size, qkvz_dim, dtype=self.qkv.dtype, device=self.qkv.device)
            self.ba = torch.full((self.size, ba_dim), float("-inf"), dtype=self.qkv.dtype, device=self.qkv.device)
            self.length = None                 # set_length() fills its padded rows too
        return self

    def set_length(self, n: int) -> None:
        """Point the padding mask and the conv-tail rows at ``n`` real tokens, and set the gate inputs of
        the padded rows to -inf (a longer step may have left real ones there). A few small ops."""
        if self.length == n:
            return
        torch.lt(self.positions[:, None], n, out=self.real)
        torch.add(self.tail_offsets, n, out=self.tail)
        for gate in (self.a, self.b, self.ba):
            if gate is not None:
                gate[n:].fill_(float("-inf"))
        self.length = n


@dataclass(frozen=True)
class GdnDims:
    conv_dim: int
    num_v_heads: int
    head_v_dim: int
    conv_width: int


def layer_view(layer) -> SimpleNamespace:
    """What the graph body needs from a vLLM ``QwenGatedDeltaNetAttention`` (after KV-cache binding)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    raw = layer.kv_cache[0]
    dim_first = is_conv_state_dim_first()
    w = layer.conv1d.weight
    return SimpleNamespace(
        conv_weight=w.view(w.size(0), w.size(2)), conv_bias=layer.conv1d.bias, activation=layer.activation,
        conv_state=raw if dim_first else raw.transpose(-1, -2), conv_state_raw=raw, conv_dim_first=dim_first,
        ssm_state=layer.kv_cache[1], A_log=layer.A_log, dt_bias=layer.dt_bias,
        num_k_heads=layer.num_k_heads // layer.tp_size, head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim,
        chunk_rule=layer.chunk_gated_delta_rule,
        # scope "layer": how vLLM's packed op splits its inputs and normalises its output
        qkv_size=(layer.key_dim * 2 + layer.value_dim) // layer.tp_size, value_size=layer.value_dim // layer.tp_size,
        split_ba=layer.split_ba, rms_norm_gated=layer._rms_norm_gated_cuda)


def single_sequence_core(view, bucket: Bucket, kernels: GdnKernels, x: torch.Tensor | None = None,
                         b: torch.Tensor | None = None, a: torch.Tensor | None = None) -> None:
    """One GDN layer's core for one padded sequence: reads ``bucket.qkv/a/b`` (or the given views of a
    bucket's packed buffers), writes ``bucket.out`` and the sequence's conv / SSM state lines.
    Graph-capturable: no host synchronisation, every tensor it reads or writes has a fixed address."""
    x = bucket.qkv if x is None else x
    b = bucket.b if b is None else b
    a = bucket.a if a is None else a
    y = kernels.conv(x.transpose(0, 1), view, bucket.has_init, bucket.lines, bucket.query_start_loc,
                     bucket.conv_meta).transpose(0, 1)
    # The kernel stored the last width-1 inputs of the PADDED sequence; store the real ones.
    tail = x.index_select(0, bucket.tail)                                 # [width-1, dim]
    view.conv_state_raw[bucket.lines] = (tail.transpose(0, 1) if view.conv_dim_first else tail).unsqueeze(0).to(
        view.conv_state_raw.dtype)
    # padded rows: a = b = -inf, so g = 0 (the state passes them unchanged) and beta = 0 (no write)
    q, k, v, g, beta = kernels.prep(y, a, b, view)
    h0 = view.ssm_state[bucket.lines]
    h0 = torch.where(bucket.has_init.view(-1, 1, 1, 1), h0, torch.zeros_like(h0))
    o, final = kernels.rule(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0), h0,
                            bucket.query_start_loc, bucket.chunk_indices, bucket.chunk_offsets, layer=view)
    view.ssm_state[bucket.lines] = final.to(view.ssm_state.dtype)
    bucket.out.copy_(o.reshape(bucket.out.shape))


def single_sequence_layer(view, bucket: Bucket, kernels: GdnKernels) -> None:
    """Scope ``layer``: vLLM's packed GDN op for one padded sequence, reading ``bucket.qkvz/ba`` and
    writing the gated-norm output to ``bucket.out``. The split and the norm are row-wise, so padded
    rows stay out of the real ones as in :func:`single_sequence_core`."""
    mixed_qkv, gate, b, a = kernels.split(bucket.qkvz, bucket.ba, view)
    single_sequence_core(view, bucket, kernels, mixed_qkv, b, a)
    kernels.norm(bucket.out, gate, bucket.out, view)


# --------------------------------------------------------------------------- runner


def capture_graph(body: Callable[[], Any], pool) -> tuple["torch.cuda.CUDAGraph", Any]:
    """Capture ``body()`` into a CUDA graph in the memory pool ``pool`` (graphs of one runner share it:
    they replay one after another), after running it twice on a side stream so that autotuning, JIT
    compiles and library workspaces happen outside the capture. Returns the graph and what the
    captured call returned (its static output). Used by this runner and the head graphs'."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = body()
    return graph, out


@dataclass
class GraphStats:
    """Counters of a graph runner (this one and :mod:`clef_vllm.worker.fast.head_graphs`)."""

    replays: int = 0
    layer_replays: int = 0          # prefill graphs: of which scope "layer"
    captures: int = 0
    fallbacks: Counter = field(default_factory=Counter)


def gdn_layers(model: torch.nn.Module) -> list:
    """``model``'s GDN layers (vLLM's ``QwenGatedDeltaNetAttention`` modules), in module order."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    return [m for m in model.modules() if isinstance(m, QwenGatedDeltaNetAttention)]


def triton_gdn(model: torch.nn.Module, label: str) -> bool:
    """Whether ``model``'s GDN layers run vLLM's Triton prefill kernels, which the plugin's prefill graphs hold
    and its GDN tuning tunes; if they run another backend (vLLM's ``gdn_prefill_backend`` choice, e.g.
    FlashInfer), the feature named ``label`` says in the log that it is off."""
    backends = {getattr(m, "gdn_prefill_backend", "triton") for m in gdn_layers(model)}
    other = sorted(backends - {"triton"})
    if other:
        log.info("clef %s: off: the GDN prefill runs on %s (the feature is for vLLM's Triton GDN kernels; "
                 "--gdn-prefill-backend triton turns it on)", label, ", ".join(other))
        return False
    return True


class GdnGraphRunner:
    """Owns the per-(layer, bucket) graphs and replays them for eligible steps.

    ``install(model)`` wraps the ``_forward_core`` of every GDN layer of ``model``; the wrapper
    replays a graph when :func:`fallback_reason` says the step is eligible and calls vLLM's own
    method otherwise (and for vLLM's own warm-up and capture runs).
    """

    def __init__(self, buckets: Sequence[int] = DEFAULT_BUCKETS, *, max_tokens: int | None = None,
                 kernels: GdnKernels | None = None, scope: str = "core"):
        if scope not in SCOPES:
            raise ValueError(f"prefill graph scope {scope!r}: choose from {', '.join(SCOPES)}")
        buckets = sorted({int(b) for b in buckets if b > 0 and (max_tokens is None or b <= max_tokens)})
        self.buckets = tuple(buckets)
        self.scope = scope
        self.kernels = kernels
        self.stats = GraphStats()
        self._buckets: dict[int, Bucket] = {}
        self._graphs: dict[tuple[str, int, str], torch.cuda.CUDAGraph] = {}
        self._broken: set[tuple[str, int, str]] = set()
        self._views: dict[str, SimpleNamespace] = {}
        self.prefixes: list[str] = []              # every wrapped GDN layer
        self._bodies: dict[tuple[str, int, str], SimpleNamespace] = {}   # key -> .replay() runs the body
        self._pool = None
        self.min_tokens = 4
        #: For a graph that encloses whole steps (step_graphs.py): run a captured bucket's
        #: body instead of replaying its graph, do not fall back while a stream is capturing, copy all
        #: the step's (padded) rows, and leave the bucket's length to the caller (``set_length`` before
        #: the enclosing capture and each replay). The state line and initial-state flag come from
        #: ``inline_sources[id(metadata)]``: static tensors per KV-cache group that the caller fills
        #: before each replay (with none registered, from the metadata itself, as outside inline mode).
        #: A (layer, bucket) without a graph yet still falls back.
        self.inline = False
        self.inline_sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ installation

    def install(self, model: torch.nn.Module) -> int:
        """Wrap every GDN layer of ``model``; returns how many were wrapped."""
        count = 0
        for module in gdn_layers(model):
            if not getattr(module, "_clef_graphs", False):
                original = module._forward_core
                module._forward_core = self._wrap(module, original)
                if self.scope == "layer":
                    module._forward_core_fused_norm_packed = self._wrap_packed(
                        module, module._forward_core_fused_norm_packed)
                module._clef_graphs = True
                self.prefixes.append(module.prefix)
                self.min_tokens = max(self.min_tokens, module.conv_kernel_size)
                count += 1
        return count

    def _wrap(self, layer, original):
        def forward_core(mixed_qkv, b, a, core_attn_out):
            if not self.run(layer, mixed_qkv, b, a, core_attn_out):
                original(mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=core_attn_out)
        # scope "layer" marks the packed op instead (profile phases must not nest)
        return trace.phased(trace.PHASE_GDN_CORE, forward_core) if self.scope == "core" else forward_core

    def _wrap_packed(self, layer, original):
        def forward_core_fused_norm_packed(mixed_qkvz, ba, core_attn_out):
            if not self.run_layer(layer, mixed_qkvz, ba, core_attn_out):
                original(mixed_qkvz=mixed_qkvz, ba=ba, core_attn_out=core_attn_out)  # its core may still replay
        return trace.phased(trace.PHASE_GDN_CORE, forward_core_fused_norm_packed)

    # ------------------------------------------------------------------ one layer call

    def _eligible(self, layer, scope: str, like: torch.Tensor, ba_dim: int = 0):
        """``(forward context, metadata, bucket, graph)`` when this step replays ``scope``'s graph of ``layer``,
        else ``None`` (the reason is counted; scope ``layer`` does not count the fallbacks its ``core`` call
        counts). In inline mode the "graph" is the captured body."""
        from vllm.forward_context import get_forward_context

        step = get_forward_context()
        md_all = step.attn_metadata
        md = md_all.get(layer.prefix) if isinstance(md_all, dict) else None
        reason = fallback_reason(md, self.buckets, self.min_tokens)
        if reason is None and not self.inline and torch.cuda.is_current_stream_capturing():
            reason = "capturing"
        if reason is not None:
            if scope == "core":
                self.stats.fallbacks[reason] += 1
            return None
        size = choose_bucket(md.num_actual_tokens, self.buckets)
        key = (layer.prefix, size, scope)
        failed = "capture_failed" if scope == "core" else "capture_failed_layer"
        if key in self._broken:
            self.stats.fallbacks[failed] += 1
            return None
        bucket = self._bucket(size, layer, like)
        if scope == "layer":
            bucket.packed(like.shape[-1], ba_dim)
        if self.inline:
            graph = self._bodies.get(key)
            if graph is None:
                self.stats.fallbacks["inline_uncaptured"] += 1
            return None if graph is None else (step, md, bucket, graph)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(layer, bucket, key)
            if graph is None:
                self.stats.fallbacks[failed] += 1
                return None
        return step, md, bucket, graph

    def _replay(self, found, inputs: Sequence[tuple[str, torch.Tensor]], core_attn_out: torch.Tensor) -> None:
        """Point the bucket at this step (length, state line, initial-state flag), copy the real rows of
        ``inputs`` (pairs of the bucket's buffer name, step tensor) in, replay, copy the real output rows out.

        The state line and the flag are the same for every layer of a KV-cache group in one step, so
        they are copied when the step (vLLM's forward context, new for every forward) or the group's
        metadata changes, not for each of the 24 layers."""
        step, md, bucket, graph = found
        source = None                              # (state line, flag) to copy into the bucket, if any
        if self.inline:         # inside a step graph: every padded row, the caller's mask, the static sources
            rows = inputs[0][1].shape[0]
            source = self.inline_sources.get(id(md), (md.prefill_state_indices[:1], md.prefill_has_initial_state[:1]))
            bucket.fed = None
        else:
            rows = md.num_actual_tokens
            bucket.set_length(rows)
            if bucket.fed is None or bucket.fed[0] is not step or bucket.fed[1] is not md:
                source = (md.prefill_state_indices[:1], md.prefill_has_initial_state[:1])
                bucket.fed = (step, md)
        if source is not None:
            bucket.lines.copy_(source[0])
            bucket.has_init.copy_(source[1])
        for name, given in inputs:
            if self.inline:
                # The step graph's padded rows hold whatever its memory held (FA3 writes no row after the
                # last sequence's), NaN and Inf included, and the chunked delta rule mixes rows through
                # products (0 * NaN is NaN, in the state and in the real rows of the last chunk): select
                # zeros for them instead, or -inf for the gate inputs (as set_length keeps them outside).
                pad = bucket.minus_inf if name in GATE_INPUTS else bucket.zero
                torch.where(bucket.real[:rows], given[:rows], pad, out=getattr(bucket, name)[:rows])
            else:
                getattr(bucket, name)[:rows].copy_(given[:rows])
        graph.replay()
        core_attn_out[:rows].copy_(bucket.out[:rows])
        self.stats.replays += 1

    def run(self, layer, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
            core_attn_out: torch.Tensor) -> bool:
        """Replay this layer's core graph for the current step; ``False``: the caller runs vLLM's path."""
        found = self._eligible(layer, "core", mixed_qkv)
        if found is None:
            return False
        self._replay(found, (("qkv", mixed_qkv), ("b", b), ("a", a)), core_attn_out)
        return True

    def run_layer(self, layer, mixed_qkvz: torch.Tensor, ba: torch.Tensor, core_attn_out: torch.Tensor) -> bool:
        """Scope ``layer``: replay the packed op's graph (split + core + gated norm); ``False``: the caller
        runs vLLM's packed op (whose core call may still replay the ``core`` graph). Installed only for
        scope ``layer``."""
        found = self._eligible(layer, "layer", mixed_qkvz, ba.shape[-1])
        if found is None:
            return False
        self._replay(found, (("qkvz", mixed_qkvz), ("ba", ba)), core_attn_out)
        self.stats.layer_replays += 1
        return True

    # ------------------------------------------------------------------ buckets and capture

    def _view(self, layer) -> SimpleNamespace:
        view = self._views.get(layer.prefix)
        if view is None:
            view = self._views[layer.prefix] = layer_view(layer)
        return view

    def _bucket(self, size: int, layer, like: torch.Tensor) -> Bucket:
        bucket = self._buckets.get(size)
        if bucket is None:
            from vllm.third_party.flash_linear_attention.ops.index import (prepare_chunk_indices,
                                                                           prepare_chunk_offsets)
            from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata

            device = like.device
            cu_cpu = torch.tensor([0, size], dtype=torch.int32)
            nums, batch_ptr, offsets_ptr = compute_causal_conv1d_metadata(cu_cpu, device=device)
            meta = SimpleNamespace(nums_dict=nums, batch_ptr=batch_ptr, token_chunk_offset_ptr=offsets_ptr)
            chunk_indices = prepare_chunk_indices(cu_cpu, CHUNK_SIZE).to(device)
            chunk_offsets = prepare_chunk_offsets(cu_cpu, CHUNK_SIZE).to(device)
            dims = GdnDims(conv_dim=(layer.key_dim * 2 + layer.value_dim) // layer.tp_size,
                           num_v_heads=layer.num_v_heads // layer.tp_size,
                           head_v_dim=layer.head_v_dim, conv_width=layer.conv_kernel_size)
            bucket = self._buckets[size] = Bucket(size, dims, device, like.dtype, meta, chunk_indices, chunk_offsets)
        return bucket

    def _capture(self, layer, bucket: Bucket, key) -> "torch.cuda.CUDAGraph | None":
        view = self._view(layer)
        kernels = self.kernels or vllm_kernels()
        self.kernels = kernels

        body_of = single_sequence_layer if key[2] == "layer" else single_sequence_core

        def body():
            body_of(view, bucket, kernels)

        try:
            bucket.lines.fill_(SCRATCH_LINE)
            bucket.has_init.fill_(False)
            bucket.set_length(bucket.size)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with memory.LEDGER.taking(memory.GDN_GRAPHS):
                graph, _ = capture_graph(body, self._pool)
        except Exception as exc:  # noqa: BLE001 - a capture failure must only cost speed
            self._broken.add(key)
            log.warning("clef prefill graphs: %s capture for %s at %d tokens failed (%s: %s); that bucket uses "
                        "%s", key[2], key[0], key[1], type(exc).__name__, exc,
                        "the core graph" if key[2] == "layer" else "vLLM's path")
            return None
        finally:
            bucket.length = None            # set_length() runs again for the real step
            bucket.fed = None               # and so do the state line and flag the capture overwrote
        self._graphs[key] = graph
        self._bodies[key] = SimpleNamespace(replay=body)
        self.stats.captures += 1
        return graph

    def describe(self) -> dict:
        return {"scope": self.scope, "buckets": list(self.buckets), "graphs": len(self._graphs),
                "replays": self.stats.replays, "layer_replays": self.stats.layer_replays,
                "captures": self.stats.captures, "fallbacks": dict(self.stats.fallbacks)}


def cudagraph_capture_sizes(max_tokens: int, buckets: Sequence[int] = DEFAULT_BUCKETS, max_num_seqs: int = 256,
                            *, between_buckets: bool = True) -> list[int]:
    """vLLM's piecewise capture sizes, extended with the GDN buckets.

    vLLM's default stops at ``min(2 x max_num_seqs, 512)`` tokens, so a ~400-token request on a
    server with 128 sequences runs its linear layers without graphs; capturing the buckets too
    lets a single-sequence step replay every part of the backbone.

    vLLM pads a step to the next capture size, and a whole-step graph (scope ``step``) exists only for
    bucket sizes: ``between_buckets=False`` drops vLLM's finer sizes above the smallest bucket, so that
    every single-sequence step of up to the largest bucket pads to one (a 100-token decision to 128,
    not to 104). Steps of several sequences pad to these sizes too (running such a step at its own
    size instead did not pay: docs/latency.md).
    """
    top = min(2 * max_num_seqs, 512)
    sizes = {1, 2, 4} | set(range(8, min(top, 256) + 1, 8)) | set(range(256, top + 1, 16))
    if not between_buckets and buckets:
        sizes = {s for s in sizes if s <= min(buckets)}
    sizes |= set(buckets)
    return sorted(s for s in sizes if s <= max_tokens)

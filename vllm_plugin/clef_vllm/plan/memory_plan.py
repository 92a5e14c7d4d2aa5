"""The GPU memory plan: what a Clef checkpoint and the server's features take of a memory budget, and
what that leaves vLLM for its KV cache.

The budget is ``--gpu-memory-utilization`` of the device's memory. The plan counts, in bytes:

* **weights**, exactly, from the parameter shapes vLLM 0.28 builds for the checkpoint's config: FP8 W8A8
  linears (1 byte a weight + a float32 scale per output channel), NVFP4 W4A4 linears as the chosen kernel
  stores them (``bf16``: 2 bytes a weight; ``vllm``: 0.5 byte a weight + an FP8 block scale per 16
  weights + the fused module's global scales), BF16 linears (unquantized modules: the Hybrid's GDN
  ``in_proj_a`` / ``in_proj_b``), the BF16 leftovers (norms, GDN ``conv1d`` / ``A_log`` / ``dt_bias``,
  the rotary cache), the token tables (int8 + a float32 scale per row in a repacked checkpoint, 16-bit
  in a release-layout one), the joint head (its parameters in the head's dtype) and the vision tower
  (BF16 in every layout; none with ``--text-only``);
* **vLLM's runtime**: one step's activations, the vision encoder on the largest image (vLLM profiles it), vLLM's
  CUDA graphs, memory held outside PyTorch's allocator, the CUDA context;
* **the plugin's features**: the prefill (GDN) graphs, the whole-step graphs, the head graphs, the head's
  GEMM warm-up (a transient peak: only what exceeds one step's activations counts) and the state cache's
  memory rows;
* **the KV cache**: the rest, in blocks, tokens and sequences of ``--max-model-len`` tokens exactly as
  vLLM 0.28 counts them (:class:`~clef_vllm.plan.shapes.KvLayout`).

The non-weight costs are module constants measured on the 9B (``REF_*`` shapes) and scaled linearly to
other shapes; each says what it models. Pure arithmetic on config dicts: no torch, no GPU, no vLLM.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Sequence

from clef_vllm.plan.graph_costs import gdn_live_bytes, gdn_prefill_bytes, graph_reservation, worst_prefill_lengths
from clef_vllm.plan.shapes import (DTYPE_BYTES, GIB, NVFP4_GROUP, NVFP4_KERNELS, KvLayout, ModelShape,  # noqa: F401 - API
                                   model_shape_for_checkpoint)


# --------------------------------------------------------------------------- calibrated constants

#: The 9B shapes the constants below were measured at (hidden, intermediate, decoder layers, head width,
#: max_model_len); a constant scales linearly from them to another checkpoint's shapes.
REF_HIDDEN, REF_INTERMEDIATE, REF_LAYERS, REF_WIDTH, REF_MODEL_LEN = 4096, 12288, 32, 1024, 16384

#: One step's activation peak per batched token (vLLM's profiling run at ``--max-num-batched-tokens``:
#: the backbone's widest intermediates, the GDN prefill's chunk tensors, the head's per-token stage).
#: Scales with hidden + intermediate size. 2.0 GiB at 16,384 tokens on the 9B: with the entries below,
#: vLLM's non-weight memory of the 9B Hybrid at a 14.33 GiB budget came to 3.22 GiB (H100,
#: ``bench/results/memory_budget.json``'s commands).
ACTIVATION_BYTES_PER_TOKEN = 128 << 10
#: vLLM's piecewise CUDA graphs' memory per token of their largest capture size: their pools held 1.03 GiB for
#: captures up to 4,096 tokens on the 9B Hybrid (H100; vLLM's own estimate, subtracted from the KV cache since
#: vLLM 0.21, said 0.75 GiB: the worker keeps the difference, :data:`VLLM_GRAPH_UNDERCOUNT`). The prefill graphs
#: make vLLM capture up to their largest bucket; otherwise it ends at ``min(2 x max_num_seqs, 512)``; at least
#: :data:`VLLM_GRAPH_MIN_BYTES`. Scales with hidden + intermediate size.
VLLM_GRAPH_BYTES_PER_TOKEN = int(1.03 * GIB / 4096)
#: How much more vLLM's graphs held than vLLM's estimate of them (1.03 / 0.75 GiB): the worker takes this share
#: of vLLM's estimate out of the KV cache too.
VLLM_GRAPH_UNDERCOUNT = 0.4
VLLM_GRAPH_MIN_BYTES = int(0.15 * GIB)
MAX_CAPTURE_SIZE = 512
#: What the process adds outside PyTorch's allocator while vLLM profiles (cuBLAS and Triton workspaces,
#: attention-backend buffers); vLLM counts it.
NON_TORCH_BYTES = int(0.45 * GIB)
#: The CUDA context and the kernels' modules. vLLM sizes its budget after the context exists, so its own
#: accounting leaves this out; the worker measures it and takes it out of the KV cache
#: (:mod:`clef_vllm.worker.budget`), so that the process, as ``nvidia-smi`` sees it, stays within the budget.
CUDA_CONTEXT_BYTES = int(0.87 * GIB)
#: Memory outside PyTorch's allocator that comes after the KV cache is sized (CUDA graph executables, the
#: workspaces of graph captures): the worker keeps this much free under its cap of the allocator.
NON_TORCH_GROWTH_BYTES = int(0.3 * GIB)
#: The head's GEMM warm-up: transient bytes per row of its largest row count. Scales with hidden + head width.
#: It runs inside vLLM's profiling and frees what it takes, so only the part above the step's other transients
#: raises the peak. Measured on the 9B Hybrid (24 GB row of bench/results/memory_budget.json): with the warm-up at
#: 16,384 rows, vLLM's profiling peaked at 2.56 GiB, 0.88 GiB of it the GDN prefill probe's, so the warm-up
#: held at most 1.68 GiB: 100 KiB a row is 1.56 GiB.
GEMM_WARMUP_BYTES_PER_ROW = 100 << 10
#: The row count :func:`fit` caps the GEMM warm-up at first.
GEMM_WARMUP_CAP_ROWS = 4096
#: What :func:`fit` lowers the step's token budget and the prefill graphs' largest token count to.
LEAN_BATCHED_TOKENS, LEAN_PREFILL_BUCKET = 8192, 2048
#: What a served step holds beyond the peak of vLLM's profiling step, per batched token: a step of ~8,000 tokens
#: (a 16,384-token decision's first chunk) held 1.65 GiB above the weights, the KV cache and the graph pools where
#: the profile (its GDN prefill core included, :mod:`clef_vllm.worker.gdn_profile`) peaked at 1.20 GiB (9B Hybrid,
#: H100, run 3 of ``bench/results/memory_budget_earlier_runs.txt``); 0.6 GiB at 8,192 tokens. The worker keeps it out of the KV cache.
RUNTIME_EXCESS_BYTES_PER_TOKEN = int(0.6 * GIB / 8192)


def served_step_excess(hidden: int, intermediate: int, batched_tokens: int) -> int:
    """:data:`RUNTIME_EXCESS_BYTES_PER_TOKEN` for a step of ``batched_tokens``, scaled by hidden + intermediate
    size: the plan's figure and the worker's reservation."""
    width = (hidden + intermediate) / (REF_HIDDEN + REF_INTERMEDIATE)
    return int(RUNTIME_EXCESS_BYTES_PER_TOKEN * width * batched_tokens)


#: The vision encoder's transient per patch of the image it runs on, at the 9B's tower (hidden 1152, MLP 4304;
#: scales with their sum): vLLM's profiling runs the encoder on the largest image one step may hold. An upper
#: bound: with 16 MP images (65,536 patches) the seeing 9B Hybrid's profile peaked at 2.62 GiB at 16,384 batched
#: tokens, where the text-only engine's step alone peaks at 2.56 (H100, bench/results/h100_9b_media_speed.json),
#: so the encoder holds at most ~42 KB a patch; 40 KB is 2.5 GiB at 16 MP, 0.63 GiB at 4 MP.
VISION_BYTES_PER_PATCH = 40 << 10
#: The largest image the release's processor makes: its ``max_pixels`` (16 MP); one token per 32 x 32 px after the
#: 2 x 2 merge, one patch per 16 x 16 px.
VISION_MAX_PIXELS = 16_777_216
VISION_PIXELS_PER_TOKEN = 1024
VISION_REF_WIDTH = 1152 + 4304
#: What :func:`fit` lowers the largest image to (``--max-image-pixels``; larger images get 413): 4 MP, 4,096 tokens.
LEAN_IMAGE_PIXELS = 4_194_304

#: The head's transient when it decides one record, in memory rows' bytes per row (the normalised memory, its keys
#: and values, the padded copy): the worker's profiling decides one ``max_model_len`` record.
HEAD_DECISION_ROW_FACTOR = 6
#: :func:`fit`'s second, smaller step token budget.
LEANER_BATCHED_TOKENS = 4096
#: What :func:`fit` lowers ``--max-num-seqs`` to: the sequences one step prefills, each with its GDN states.
LEAN_SEQUENCES = 32
#: The prefill graphs' largest default bucket (``clef_vllm.worker.fast.prefill_graphs.DEFAULT_BUCKETS``).
DEFAULT_MAX_BUCKET = 4096

#: :func:`fit`'s default target: the KV cache holds this many sequences of ``max_model_len`` tokens (at 9B with
#: 16,384 tokens, 3.05 GiB: what the Hybrid's 16 GB card is built to leave for it).
MIN_SEQUENCES = 5
#: :func:`choose_nvfp4_kernel` picks BF16 NVFP4 weights only when they leave this many sequences.
MIN_BF16_SEQUENCES = 4



class PlanDoesNotFit(RuntimeError):
    """Even the leanest settings leave the KV cache less than one ``max_model_len`` sequence; the message
    names the biggest consumers and the flags that would free memory."""


# --------------------------------------------------------------------------- inputs and the plan


def batched_tokens(max_num_batched_tokens: int | None, max_model_len: int) -> int:
    """A step's token budget: ``--max-num-batched-tokens`` when given, else the request limit, at least 8192
    and at most 16384 (one chunk holds a typical prompt)."""
    return int(max_num_batched_tokens or max(8192, min(int(max_model_len), 16384)))


@dataclass(frozen=True)
class PlanInputs:
    """The budget and the server settings that decide memory.

    ``nvfp4_kernel``: ``bf16`` (NVFP4 layers dequantized to BF16 at load) or ``vllm`` (packed). A
    ``head_graph_records`` of 0 is the head graphs off; ``prefill_max_bucket`` is the prefill graphs' largest token count (capped by
    the step's token budget); ``gemm_warmup_rows`` ``None`` is the worker's
    row count (``max(max_num_batched_tokens, max_model_len)``); ``state_cache_bytes`` ``None`` is the
    worker's share of the KV room (the memory rows of every token the KV cache can hold), 0 is the state
    cache off (and vLLM's prefix caching with it)."""

    budget_bytes: int
    max_model_len: int = REF_MODEL_LEN
    max_num_seqs: int = 128
    max_num_batched_tokens: int = REF_MODEL_LEN
    nvfp4_kernel: str = "bf16"
    cuda_graphs: bool = True
    head_graph_records: int = 16
    prefill_graphs: bool = True
    prefill_max_bucket: int = DEFAULT_MAX_BUCKET
    step_graphs: bool = True
    gemm_warmup: bool = True
    gemm_warmup_rows: int | None = None
    state_cache_bytes: int | None = None
    int8_embedding: bool = True
    head_dtype: str = "bfloat16"
    vision: bool = True                   # the vision tower loaded (a checkpoint that has one, without --text-only)
    image_pixels: int = VISION_MAX_PIXELS  # the largest image the engine takes (vLLM profiles its encoder on it)

    @classmethod
    def from_options(cls, options, budget_bytes: int, **overrides) -> "PlanInputs":
        """The inputs of a ``clef_vllm.backends.options.VllmOptions`` (``nvfp4_kernel`` may stay ``auto``:
        :func:`choose_nvfp4_kernel` resolves it); ``overrides``: fields set on top."""
        prefill = bool(options.prefill_graphs)
        values = dict(
            budget_bytes=int(budget_bytes), max_model_len=int(options.max_model_len),
            max_num_seqs=int(options.max_num_seqs),
            max_num_batched_tokens=batched_tokens(options.max_num_batched_tokens, options.max_model_len),
            nvfp4_kernel=options.nvfp4_kernel, cuda_graphs=not options.enforce_eager,
            head_graph_records=options.head_graph_records if options.head_graphs else 0,
            prefill_graphs=prefill, prefill_max_bucket=max(options.prefill_graph_buckets or (DEFAULT_MAX_BUCKET,)),
            step_graphs=prefill and options.resolved_prefill_graph_scope == "step",
            gemm_warmup=bool(options.gemm_warmup), gemm_warmup_rows=options.gemm_warmup_rows,
            state_cache_bytes=None if options.state_cache else 0, head_dtype=options.head_dtype or options.dtype,
            vision=not options.text_only, image_pixels=min(options.largest_image_pixels or VISION_MAX_PIXELS,
                                                           VISION_MAX_PIXELS))
        values.update(overrides)
        return cls(**values)

    @property
    def state_cache(self) -> bool:
        """The state cache on (and with it vLLM's prefix caching, mamba cache mode ``align``)."""
        return self.state_cache_bytes != 0

    @property
    def warmup_rows(self) -> int:
        """Rows the GEMM warm-up runs up to (0: off)."""
        if not self.gemm_warmup:
            return 0
        default = max(self.max_num_batched_tokens, self.max_model_len)
        return default if self.gemm_warmup_rows is None else min(self.gemm_warmup_rows, default)


@dataclass(frozen=True)
class Part:
    """One line of the plan: ``group`` is ``weights``, ``vllm`` (vLLM's runtime) or ``plugin``."""

    name: str
    bytes: int
    note: str = ""
    group: str = "weights"


@dataclass(frozen=True)
class MemoryPlan:
    """Every part of the budget, and the KV cache the rest makes. ``changes``: what :func:`fit` turned down
    or off to get here, one line each."""

    model: ModelShape
    inputs: PlanInputs
    parts: tuple[Part, ...]
    changes: tuple[str, ...] = ()

    @property
    def budget_bytes(self) -> int:
        return self.inputs.budget_bytes

    @property
    def kv_bytes(self) -> int:
        """What the budget leaves the KV cache (negative: over the budget by that much)."""
        return self.inputs.budget_bytes - sum(p.bytes for p in self.parts)

    @property
    def kv_blocks(self) -> int:
        return self.model.kv.blocks(self.kv_bytes)

    @property
    def kv_tokens(self) -> int:
        """vLLM's "GPU KV cache size" for ``kv_bytes``."""
        return self.model.kv.tokens(self.kv_bytes, self.inputs.max_model_len, self.inputs.state_cache)

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency for ``max_model_len`` tokens per request"."""
        return self.model.kv.concurrency(self.kv_bytes, self.inputs.max_model_len, self.inputs.state_cache)

    def bytes_of(self, group: str) -> int:
        return sum(p.bytes for p in self.parts if p.group == group)

    def describe(self) -> list[str]:
        """The plan as a table, one line per part, then what is left for the KV cache."""
        i, kv = self.inputs, self.model.kv
        lines = [f"GPU memory plan: budget {gib(i.budget_bytes)} GiB; max_model_len {i.max_model_len:,}, "
                 f"max_num_seqs {i.max_num_seqs}, max_num_batched_tokens {i.max_num_batched_tokens:,}, "
                 f"NVFP4 kernel {i.nvfp4_kernel}"]
        titles = {"weights": "weights", "vllm": "vLLM runtime", "plugin": "plugin features"}
        for group, title in titles.items():
            parts = [p for p in self.parts if p.group == group]
            lines.append(f"  {title:<44s} {gib(self.bytes_of(group)):>8s} GiB")
            for p in parts:
                lines.append(f"    {p.name:<42s} {gib(p.bytes):>8s} GiB  {p.note}".rstrip())
        seq = kv.bytes_for(1, i.max_model_len, i.state_cache)
        lines.append(f"  {'KV cache':<44s} {gib(self.kv_bytes):>8s} GiB  {self.kv_tokens:,} tokens, "
                     f"{self.max_concurrency:.2f}x {i.max_model_len:,}-token sequences "
                     f"({gib(seq)} GiB each; blocks of {kv.block_size} tokens)")
        lines += [f"  fit: {c}" for c in self.changes]
        return lines

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "inputs": asdict(self.inputs),
                "parts": [asdict(p) for p in self.parts], "kv_bytes": self.kv_bytes, "kv_blocks": self.kv_blocks,
                "kv_tokens": self.kv_tokens, "max_concurrency": round(self.max_concurrency, 4),
                "block_size": self.model.kv.block_size, "changes": list(self.changes)}


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _ratio(*pairs: tuple[float, float]) -> float:
    out = 1.0
    for value, ref in pairs:
        out *= value / ref
    return out


def weight_parts(model: ModelShape, inputs: PlanInputs) -> list[Part]:
    """The weights by part, in bytes (see the module docstring for each part's layout)."""
    m, i = model, inputs
    if inputs.nvfp4_kernel not in NVFP4_KERNELS:
        raise ValueError(f"nvfp4_kernel {inputs.nvfp4_kernel!r}: one of {NVFP4_KERNELS} (resolve 'auto' with "
                         "choose_nvfp4_kernel)")
    if inputs.nvfp4_kernel == "bf16":
        nvfp4 = 2 * m.nvfp4_weights
        how = "dequantized to BF16 at load"
    else:
        nvfp4 = m.nvfp4_weights // 2 + m.nvfp4_weights // NVFP4_GROUP + 16 * m.nvfp4_modules
        how = "packed: 4 bits + an FP8 scale per 16"
    table = m.vocab * m.hidden
    int8 = table + 4 * m.vocab
    embed_int8 = m.int8_tables and inputs.int8_embedding
    head_bytes = DTYPE_BYTES[inputs.head_dtype]
    parts = [
        Part("FP8 W8A8 linears", m.fp8_weights + 4 * m.fp8_channels, f"layers {_span(m.fp8_layers)}, "
             f"{m.fp8_modules} modules" if m.fp8_modules else ""),
        Part(f"NVFP4 W4A4 linears ({inputs.nvfp4_kernel})", nvfp4,
             f"layers {_span(m.nvfp4_layers)}, {m.nvfp4_modules} modules, {how}" if m.nvfp4_modules else ""),
        Part("BF16 linears", 2 * m.bf16_linear_weights, "unquantized modules"),
        Part("BF16 leftovers", m.leftover_bytes, "norms, GDN conv1d/A_log/dt_bias, rotary cache"),
        Part("embedding", int8 if embed_int8 else 2 * table,
             "int8 + a float32 scale per row" if embed_int8 else "16-bit"),
        Part("lm_head table", int8 if m.int8_tables else 2 * table,
             "int8 + a float32 scale per row" if m.int8_tables else "16-bit (release layout)"),
        Part("vision tower", 2 * m.vision_params if m.vision and i.vision else 0,
             (f"BF16, {m.vision_params:,} parameters" if i.vision else "not loaded (--text-only)") if m.vision
             else "none"),
        Part(f"joint head ({inputs.head_dtype})", head_bytes * m.head_params, f"{m.head_params:,} parameters"),
    ]
    return [p for p in parts if p.bytes or p.name == "vision tower"]


def _span(layers: Sequence[int]) -> str:
    if not layers:
        return "-"
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


def plan(model: ModelShape, inputs: PlanInputs, changes: Sequence[str] = ()) -> MemoryPlan:
    """The memory plan of ``model`` under ``inputs``."""
    i, m = inputs, model
    width = _ratio((m.hidden + m.intermediate, REF_HIDDEN + REF_INTERMEDIATE))
    parts = weight_parts(m, i)

    activations = int(ACTIVATION_BYTES_PER_TOKEN * width * i.max_num_batched_tokens)
    bucket = min(i.prefill_max_bucket, i.max_num_batched_tokens) if i.prefill_graphs else 0
    capture = bucket or min(2 * i.max_num_seqs, MAX_CAPTURE_SIZE, i.max_num_batched_tokens)
    parts.append(Part("activations", activations, f"one step of {i.max_num_batched_tokens:,} tokens", "vllm"))
    # the profiling step's transients come one after another: its peak is the largest, so each counts only what
    # it adds above the ones before it (activations, the GDN prefill, the GEMM warm-up, the longest decision)
    peak = activations
    if m.gdn:
        kh, vh, kd, vd, ssm = m.gdn
        dims = dict(key_heads=kh, value_heads=vh, key_dim=kd, value_dim=vd)
        tokens = i.max_num_batched_tokens
        step = (gdn_live_bytes(tokens, hidden=m.hidden, **dims)
                + gdn_prefill_bytes(tokens, i.max_num_seqs, ssm_bytes=ssm, **dims))
        sequences = len(worst_prefill_lengths(tokens, i.max_num_seqs))
        parts.append(Part("GDN prefill", max(step - peak, 0),
                          f"its core in {sequences} sequences (run in vLLM's profiling): {gib(step)} GiB transient, "
                          "above activations only", "vllm"))
        peak = max(peak, step)
    if m.vision and i.vision and m.vision_widths:
        vh, vi, out = m.vision_widths
        tokens = i.image_pixels // VISION_PIXELS_PER_TOKEN
        encoder = int(VISION_BYTES_PER_PATCH * (vh + vi) / VISION_REF_WIDTH * 4 * tokens)
        outputs = 2 * out * tokens          # its features stay in the encoder cache for the step
        parts.append(Part("vision encoder", max(encoder - peak, 0) + outputs,
                          f"the largest image, or a video of as many tokens ({i.image_pixels / 1e6:.1f} MP, "
                          f"{tokens:,} tokens; run in vLLM's "
                          f"profiling): {gib(encoder)} GiB transient, above the step's peak; its features "
                          f"{gib(outputs)} GiB", "vllm"))
        peak = max(peak, encoder)
    parts.append(Part("beyond the profile", served_step_excess(m.hidden, m.intermediate, i.max_num_batched_tokens),
                      "what a served step holds beyond vLLM's profiling step", "vllm"))
    parts += [
              Part("vLLM CUDA graphs", max(int(VLLM_GRAPH_BYTES_PER_TOKEN * width * capture), VLLM_GRAPH_MIN_BYTES)
                   if i.cuda_graphs else 0, f"captured up to {capture:,} tokens" if i.cuda_graphs else
                   "off (enforce_eager)", "vllm"),
              Part("non-torch memory", NON_TORCH_BYTES, "workspaces outside PyTorch's allocator", "vllm"),
              Part("CUDA context", CUDA_CONTEXT_BYTES, "outside vLLM's own accounting", "vllm"),
              Part("later non-torch memory", NON_TORCH_GROWTH_BYTES, "graph executables, kept free under the cap",
                   "vllm")]

    graphs = graph_reservation(hidden=m.hidden, intermediate=m.intermediate, head_records=i.head_graph_records,
                               prefill_buckets=[bucket] if bucket else [],
                               step_graphs=bool(bucket) and i.step_graphs and i.cuda_graphs)
    notes = {"GDN graphs": f"single-sequence prefill steps up to {bucket:,} tokens" if bucket else "off",
             "step graphs": "the whole backbone of such steps" if graphs.get("step graphs") else "off",
             "head graphs": f"steps finishing up to {i.head_graph_records} requests" if i.head_graph_records
             else "off"}
    parts += [Part(name, graphs.get(name, 0), note, "plugin") for name, note in notes.items()]
    rows = i.warmup_rows
    warmup = int(GEMM_WARMUP_BYTES_PER_ROW * _ratio((m.hidden + m.head_width, REF_HIDDEN + REF_WIDTH)) * rows)
    parts.append(Part("GEMM warm-up", max(warmup - peak, 0),
                      f"up to {rows:,} rows: {gib(warmup)} GiB transient, above the step's peak" if rows else "off",
                      "plugin"))
    row = m.head_width * DTYPE_BYTES[i.head_dtype]
    share = row / (row + m.kv.attention_bytes_per_token)
    decision = HEAD_DECISION_ROW_FACTOR * row * i.max_model_len
    peak = max(peak, warmup)
    parts.append(Part("longest decision", max(decision - peak, 0),
                      f"the head on {i.max_model_len:,} memory rows (run in vLLM's profiling): {gib(decision)} GiB "
                      "transient, above the step's peak", "plugin"))
    in_flight = int(max(i.budget_bytes - sum(p.bytes for p in parts), 0) * share)
    parts.append(Part("memory rows in flight", in_flight, f"requests mid-prefill, {share:.1%} of the KV room",
                      "plugin"))
    if i.state_cache_bytes is None:          # the worker's share of what is left (pooler.side_capacity)
        room = i.budget_bytes - sum(p.bytes for p in parts[:-1])
        block_bytes = m.kv.block_size * row
        state = max(1, int(max(room, 0) * share // block_bytes)) * block_bytes
        note = f"memory rows, {share:.1%} of the KV room"
    else:
        state = i.state_cache_bytes
        note = "memory rows" if state else "off"
    parts.append(Part("state cache", state, note, "plugin"))
    return MemoryPlan(m, i, tuple(parts), tuple(changes))


# --------------------------------------------------------------------------- decisions


def choose_nvfp4_kernel(model: ModelShape, inputs: PlanInputs, capability=None) -> str:
    """``--nvfp4-kernel auto`` by memory (and speed where the GPU is known): ``bf16`` only when BF16 NVFP4
    weights leave the KV cache :data:`MIN_BF16_SEQUENCES` sequences of ``max_model_len`` (and the GPU's own
    NVFP4 kernel would be Marlin, :func:`clef_vllm.quant.kernels.resolve_nvfp4_kernel`), else ``vllm``."""
    if not model.nvfp4_modules:
        return "vllm"
    if capability is not None:
        from clef_vllm.quant.kernels import resolve_nvfp4_kernel

        if resolve_nvfp4_kernel("auto", capability) != "bf16":
            return "vllm"
    roomy = plan(model, replace(inputs, nvfp4_kernel="bf16")).max_concurrency >= MIN_BF16_SEQUENCES
    return "bf16" if roomy else "vllm"


def _warmup_cap(i: PlanInputs, rows: int):
    return replace(i, gemm_warmup_rows=rows), \
        f"GEMM warm-up capped at {rows:,} rows (larger head GEMMs load their kernels at first use)"


def _batched(i: PlanInputs, tokens: int):
    return replace(i, max_num_batched_tokens=tokens), \
        f"--max-num-batched-tokens {i.max_num_batched_tokens:,} -> {tokens:,} (longer prompts in chunks)"


def _steps(inputs: PlanInputs):
    """The feature changes :func:`fit` tries, cheapest loss first: ``(new inputs, what)``."""
    i = inputs
    if i.gemm_warmup and i.warmup_rows > GEMM_WARMUP_CAP_ROWS:
        yield _warmup_cap(i, GEMM_WARMUP_CAP_ROWS)
    if i.max_num_batched_tokens > LEAN_BATCHED_TOKENS:
        yield _batched(i, LEAN_BATCHED_TOKENS)
    if i.vision and i.image_pixels > LEAN_IMAGE_PIXELS:
        yield replace(i, image_pixels=LEAN_IMAGE_PIXELS), \
            f"--max-image-pixels {i.image_pixels:,} -> {LEAN_IMAGE_PIXELS:,} (larger images get 413)"
    if i.max_num_seqs > LEAN_SEQUENCES:
        yield replace(i, max_num_seqs=LEAN_SEQUENCES), \
            f"--max-num-seqs {i.max_num_seqs} -> {LEAN_SEQUENCES} (a step prefills at most {LEAN_SEQUENCES} requests)"
    if i.step_graphs and i.prefill_graphs and i.cuda_graphs:
        yield replace(i, step_graphs=False), "step graphs off (--prefill-graph-scope core)"
    if i.head_graph_records:
        yield replace(i, head_graph_records=0), "--head-graphs off (the joint head runs eagerly: ~1-2 ms a decision)"
    if i.prefill_graphs and i.prefill_max_bucket > LEAN_PREFILL_BUCKET:
        yield replace(i, prefill_max_bucket=LEAN_PREFILL_BUCKET), \
            f"prefill graphs up to {LEAN_PREFILL_BUCKET:,} tokens (--prefill-graph-buckets)"
    if i.max_num_batched_tokens > LEANER_BATCHED_TOKENS:
        yield _batched(i, LEANER_BATCHED_TOKENS)
    if i.gemm_warmup and i.warmup_rows > LEANER_BATCHED_TOKENS // 2:
        yield _warmup_cap(i, LEANER_BATCHED_TOKENS // 2)
    if i.prefill_graphs:
        yield replace(i, prefill_graphs=False, step_graphs=False), "--prefill-graphs off"
    if i.gemm_warmup:
        yield replace(i, gemm_warmup=False, gemm_warmup_rows=None), "--gemm-warmup off"
    if i.state_cache:
        yield replace(i, state_cache_bytes=0), "--state-cache off"


def _leanest(inputs: PlanInputs) -> PlanInputs:
    return replace(inputs, head_graph_records=0, image_pixels=min(inputs.image_pixels, LEAN_IMAGE_PIXELS),
                    prefill_graphs=False, step_graphs=False, gemm_warmup=False,
                   gemm_warmup_rows=None, state_cache_bytes=0,
                   max_num_batched_tokens=min(inputs.max_num_batched_tokens, LEAN_BATCHED_TOKENS),
                   max_num_seqs=min(inputs.max_num_seqs, LEAN_SEQUENCES))


def fit(model: ModelShape, inputs: PlanInputs, *, min_sequences: float = MIN_SEQUENCES,
        keep: frozenset[str] = frozenset()) -> MemoryPlan:
    """The plan after turning the plugin's memory-costly features down or off, in :func:`_steps`' order,
    until the KV cache holds ``min_sequences`` sequences of ``max_model_len`` tokens; each change is one line
    of the returned plan's ``changes`` (what, what it freed, why). ``keep``: :class:`PlanInputs` fields no step
    may change (the settings the operator gave). The leanest plan when even that falls short of the target;
    :class:`PlanDoesNotFit` when it holds less than one sequence."""
    current = plan(model, inputs)
    changes: list[str] = []
    while current.max_concurrency < min_sequences:
        steps = ((c, what) for c, what in _steps(current.inputs)
                 if all(getattr(c, name) == getattr(current.inputs, name) for name in keep))
        tries = ((plan(model, candidate), what) for candidate, what in steps)
        step = next(((p, what) for p, what in tries if p.kv_bytes > current.kv_bytes), None)
        if step is None:
            break
        nxt, what = step
        changes.append(f"{what}: {gib(nxt.kv_bytes - current.kv_bytes)} GiB more for the KV cache, which had "
                       f"{gib(current.kv_bytes)} GiB ({current.max_concurrency:.2f} {inputs.max_model_len:,}-token "
                       f"sequences; {min_sequences:g} wanted)")
        current = replace(nxt, changes=tuple(changes))
    if current.max_concurrency < 1:
        raise PlanDoesNotFit(does_not_fit_message(plan(model, _leanest(inputs))))
    return current


def does_not_fit_message(leanest: MemoryPlan) -> str:
    """One paragraph: the budget, what the leanest settings leave, the biggest consumers, the flags."""
    i = leanest.inputs
    need = leanest.model.kv.bytes_for(1, i.max_model_len, i.state_cache)
    top = sorted(leanest.parts, key=lambda p: p.bytes, reverse=True)[:3]
    flags = []
    if i.nvfp4_kernel == "bf16" and leanest.model.nvfp4_modules:
        packed = plan(leanest.model, replace(i, nvfp4_kernel="vllm"))
        flags.append(f"--nvfp4-kernel vllm ({gib(packed.kv_bytes - leanest.kv_bytes)} GiB less)")
    per_1k = int(ACTIVATION_BYTES_PER_TOKEN * _ratio((leanest.model.hidden + leanest.model.intermediate,
                                                      REF_HIDDEN + REF_INTERMEDIATE)) * 1024)
    if i.vision and leanest.model.vision_params:
        blind = plan(leanest.model, replace(i, vision=False))
        flags.append(f"--text-only (the vision tower and its encoder: {gib(blind.kv_bytes - leanest.kv_bytes)} GiB less)")
    flags += [f"a smaller --max-model-len ({i.max_model_len:,} now)",
              f"--max-num-batched-tokens ({i.max_num_batched_tokens:,} now; activations {gib(per_1k)} GiB per "
              "1,024 tokens)", f"--max-num-seqs ({i.max_num_seqs} now)", "--state-cache off",
              "a larger --gpu-memory-utilization"]
    return (f"Clef-Flash does not fit in a {gib(i.budget_bytes)} GiB budget: even with the plugin's graphs, GEMM "
            f"warm-up and state cache off, the KV cache gets {gib(leanest.kv_bytes)} GiB, less than one "
            f"{i.max_model_len:,}-token sequence ({gib(need)} GiB). Biggest consumers: "
            + ", ".join(f"{p.name} {gib(p.bytes)} GiB" for p in top)
            + ". To free memory: " + ", ".join(flags) + ".")


# --------------------------------------------------------------------------- checkpoints and sizes


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``16GiB``, ``15.92GiB``, ``24GB`` (10^9), ``16303MiB`` or plain bytes -> bytes. ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"expected a size such as 16GiB, 24GB, 15.92GiB or a number of bytes, got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value)


__all__ = ["GIB", "KvLayout", "MemoryPlan", "ModelShape", "Part", "PlanDoesNotFit", "PlanInputs",
           "batched_tokens", "choose_nvfp4_kernel", "does_not_fit_message", "fit", "model_shape_for_checkpoint", "parse_size",
           "plan", "weight_parts"]

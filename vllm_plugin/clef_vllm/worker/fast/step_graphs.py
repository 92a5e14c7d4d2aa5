"""One CUDA graph per padded size for the whole backbone of a single-sequence prefill step.

Why: with the GDN and head graphs, one short decision's step is still host-bound: vLLM's piecewise
graphs, the 8 attention layers and the glue between them are launched one by one, and the host's
speed on the shared machines varies by ~1.9× from minute to minute (docs/latency.md). vLLM 0.28
gives a pooling model no full CUDA graphs, so this one is the plugin's, like the GDN graphs.

What (``--prefill-graph-scope step``): a step that prefills exactly one sequence, padded by vLLM to a
size that is also a GDN bucket, replays a graph of ``model.forward`` captured for that size and kind.
The graph reads static copies of everything that changes from step to step, refreshed before each
replay: the token ids and positions, the FA3 metadata tensors (query start, sequence length, block
table, slot mapping) and the GDN state line and initial-state flag of each KV-cache group. FA3 is
captured for the padded size (every padded row, the longest query, no ahead-of-time schedule), and
so is the GDN layers' metadata (vLLM's GDN op processes and normalises ``num_actual_tokens`` rows),
so one graph serves any real length of that size; the GDN layers run their per-bucket bodies inline
(``GdnGraphRunner.inline``) and the padding mask is set outside the graph. FA3's longest sequence
is the padded size for a ``fresh`` step (nothing before it: a first chunk without a cache hit) and
the model's for a ``context`` step (a later chunk, a cache hit): each kind has its own graph per
size (:func:`step_kind`). Anything else takes the per-layer path (``core``), and a size and kind
whose capture fails stays there.

The padded rows hold whatever the graph's memory held (FA3 writes no row after the last sequence's);
the GDN bodies select zeros for them on the way in (``GdnGraphRunner._replay``), every other layer is
row-wise.

**Small batches, one sequence at a time** (``--step-graph-split N``, default
``clef_vllm.contract.DEFAULT_STEP_GRAPH_SPLIT``): a step of 2 to N prefill sequences of at most
:data:`SPLIT_TOKENS` tokens in all runs vLLM's path eagerly between its piecewise graphs: 24 GDN layers of Triton
launches whose host time exceeds the GPU's work for a few short requests (a step of three ~400-token decisions
took ~66 ms through the server where its GPU work is ~30 ms). Such a step replays each sequence's own step graph
in turn instead (:func:`split_plan`: every sequence needs a bucket and a graph already captured for it), each fed
that sequence's rows, metadata row and state line, its real output rows copied into the step's hidden states.
Sequences of a prefill step never see each other (causal attention per sequence, one recurrent state each, every
other layer row-wise), so each gets what it would get alone in a step.

Measured on an H200 (docs/latency.md): bit-identical to vLLM's path at the probed sizes
(``bench/results/h200_9b_step_graph_probe_fresh.json``; the ``fresh`` kind also where the model's longest
sequence changed FA3's split), the 240-request parity against the reference unchanged, and 8-19 % (BF16) / 18 % (FP8)
faster for one short decision through the server, paired. The default scope (``auto``) wherever it
can run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from clef_vllm.worker import memory
from clef_vllm.worker.fast.gdn_metadata import QUERY_START_CPU, SEQ_LENS_CPU
from clef_vllm.worker.fast.prefill_graphs import (SCRATCH_LINE, GdnGraphRunner, GraphStats, choose_bucket, fallback_reason,
                                             prefill_reason)

log = logging.getLogger("clef_vllm")

FA_METADATA = "FlashAttentionMetadata"
GDN_METADATA = "GDNAttentionMetadata"
#: the FA3 metadata tensors refreshed before each replay
FA_TENSORS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")


def groups(md_all: dict, kind: str) -> dict[str, Any]:
    """First layer name -> metadata object, for the KV-cache groups of one metadata class (vLLM gives
    every layer of a group the same object)."""
    out, seen = {}, set()
    for layer, md in md_all.items():
        if type(md).__name__ == kind and id(md) not in seen:
            seen.add(id(md))
            out[layer] = md
    return out


def attention_reason(md) -> str | None:
    """Why an FA3 metadata object cannot be captured for a padded size (``None``: it can)."""
    if getattr(md, "use_cascade", False):
        return "cascade"
    if getattr(md, "dcp_context_kv_lens", None) is not None or getattr(md, "mm_prefix_query_range_tensor", None) is not None:
        return "attention_features"
    if getattr(md, "causal", True) is not True:
        return "not_causal"
    return None


def step_reason(ctx, gdn_buckets: Sequence[int], min_tokens: int, sizes: Sequence[int], size: int,
                piecewise) -> str | None:
    """Why the step in forward context ``ctx``, padded to ``size`` tokens, cannot use a step graph
    (``None``: it can). ``piecewise``: vLLM's PIECEWISE runtime mode (steps in any other mode are
    vLLM's own profile, warm-up and capture runs, or sizes it does not pad)."""
    if ctx.cudagraph_runtime_mode != piecewise:
        return "not_piecewise"
    md_all = ctx.attn_metadata
    if not isinstance(md_all, dict) or not md_all:
        return "no_metadata"
    kinds = {type(md).__name__ for md in md_all.values()}
    if kinds - {FA_METADATA, GDN_METADATA}:
        return "attention_backend"
    gdn = groups(md_all, GDN_METADATA)
    if not gdn:
        return "no_gdn"
    for md in gdn.values():
        reason = fallback_reason(md, gdn_buckets, min_tokens)     # "batch": several sequences (a split's)
        if reason is not None:
            return reason
    if size not in sizes:
        return "size"
    n = next(iter(gdn.values())).num_actual_tokens
    if choose_bucket(n, gdn_buckets) is None or choose_bucket(n, gdn_buckets) < size:
        return "size"
    for md in groups(md_all, FA_METADATA).values():
        reason = attention_reason(md)
        if reason is not None:
            return reason
    return None


#: A step graph's kind: ``fresh`` steps (no sequence longer than the padded size: a first chunk without a
#: cache hit) are captured with the padded size as FA3's longest sequence, ``context`` steps (a later chunk,
#: a cache hit) with the model's. FA3 sizes its work and picks its split count from that length.
FRESH, CONTEXT = "fresh", "context"


def step_kind(md_all: dict, size: int) -> str:
    """:data:`FRESH` or :data:`CONTEXT` for a step padded to ``size`` tokens (host-side fields only)."""
    longest = max((md.max_seq_len for md in groups(md_all, FA_METADATA).values()), default=0)
    return FRESH if longest <= size else CONTEXT


#: The most tokens they may have together: above ~2,000 tokens a batched step's GPU work, not its
#: host's launches, sets its time, and one batched pass over the rows beats several replays
SPLIT_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class Part:
    """One sequence of a split step: its rows ``[start, end)`` of the step and the graph it replays."""

    start: int
    end: int
    size: int
    kind: str

    @property
    def tokens(self) -> int:
        return self.end - self.start


def split_plan(query_start: Sequence[int], seq_lens: Sequence[int], buckets: Sequence[int], min_tokens: int,
               max_seqs: int, max_tokens: int = SPLIT_TOKENS) -> list[Part] | str:
    """How a step of several prefill sequences replays their step graphs one at a time, or why it cannot (a
    fallback reason). ``query_start``: the step's query start locations on the host (``[0, n1, n1 + n2, ...]``);
    ``seq_lens``: each sequence's length after the step (context included). A sequence with nothing before
    its rows that fits its bucket takes the bucket's :data:`FRESH` graph, any other its :data:`CONTEXT` graph."""
    k = len(query_start) - 1
    if k < 2 or len(seq_lens) != k:
        return "split_metadata"
    if k > max_seqs:
        return "split_seqs"
    if query_start[0] != 0 or query_start[-1] > max_tokens:
        return "split_tokens"
    parts = []
    for i in range(k):
        start, end = int(query_start[i]), int(query_start[i + 1])
        n = end - start
        if n < min_tokens:
            return "split_too_short"
        size = choose_bucket(n, buckets)
        if size is None:
            return "split_too_long"
        parts.append(Part(start, end, size, FRESH if int(seq_lens[i]) <= size else CONTEXT))
    return parts


def refresh(static: torch.Tensor, given: torch.Tensor) -> None:
    """Copy a step's tensor into its static buffer; a shorter 1-D slot mapping leaves -1 (no KV write)
    in the padded rows after it."""
    if static.shape == given.shape:
        static.copy_(given)
    elif static.dim() == given.dim() == 1 and given.shape[0] <= static.shape[0]:
        static.fill_(-1)
        static[:given.shape[0]].copy_(given)
    else:
        raise ValueError(f"a step input of shape {tuple(given.shape)} does not fit its static {tuple(static.shape)}")


def refresh_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """:func:`refresh` every ``(static, given)`` pair: pairs of one shape, dtype and device, both contiguous,
    in one multi-tensor copy per dtype (a replay refreshes ~20 small tensors; one launch each cost host
    time while the GPU waited for the graph), the others one by one."""
    batched: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for static, given in pairs:
        if static.shape == given.shape and static.dtype == given.dtype and static.device == given.device \
                and static.is_contiguous() and given.is_contiguous():
            dst, src = batched.setdefault((static.dtype, static.device), ([], []))
            dst.append(static)
            src.append(given)
        else:
            refresh(static, given)
    for dst, src in batched.values():
        torch._foreach_copy_(dst, src)


def same_strides(given: torch.Tensor) -> torch.Tensor:
    """A copy of ``given`` with the same sizes and strides (``clone`` would make a strided view contiguous)."""
    out = torch.empty_strided(given.size(), given.stride(), dtype=given.dtype, device=given.device)
    out.copy_(given)
    return out


def shared_slots(ctx, layers: Sequence[str]) -> torch.Tensor:
    """The one slot mapping the ``layers`` of a KV-cache group share in this step (a ``ValueError`` when
    they no longer share one: a step graph copies one per group)."""
    given = ctx.slot_mapping[layers[0]]
    if any(ctx.slot_mapping[layer].data_ptr() != given.data_ptr() for layer in layers[1:]):
        raise ValueError(f"the layers {layers[0]}, ... no longer share one slot mapping")
    return given


def static_slots(given: torch.Tensor, rows: int) -> torch.Tensor:
    """A static copy of a slot mapping, as long as the padded step (-1 after the real rows)."""
    if given.dim() == 1 and given.shape[0] < rows:
        out = torch.full((rows,), -1, dtype=given.dtype, device=given.device)
        out[:given.shape[0]].copy_(given)
        return out
    return given.clone()


class StepGraph:
    """The backbone's forward for one padded size, captured on static inputs (see the module docstring)."""

    def __init__(self, gdn: GdnGraphRunner, max_len: int):
        self.gdn, self.max_len = gdn, max_len
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.captured_at: int | None = None
        self.capture_s: float | None = None
        self.ids: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.attn: dict[str, Any] = {}               # first layer of an FA3 group -> its static metadata
        #: the forward context's slot mappings, one (static, layers) per KV-cache group: vLLM gives every
        #: layer of a group one slot mapping, so a replay copies 4 of them for the 9B's 32 layers, not 32
        self.slot_groups: list[tuple[torch.Tensor, list[str]]] = []
        self.lines: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # first GDN layer -> (line, flag)

    def _bucket(self, n: int):
        return self.gdn._buckets[choose_bucket(n, self.gdn.buckets)]

    def statics(self, ctx, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[dict, dict]:
        """Make the static inputs from this step's; returns the attention metadata and slot mappings the
        capture runs with."""
        size = int(input_ids.shape[0])
        # the compiled backbone was traced on the runner's own buffers: keep their strides (M-RoPE
        # positions are a [3, N] view of a longer buffer), not just their values
        self.ids, self.pos = same_strides(input_ids), same_strides(positions)
        md_all = dict(ctx.attn_metadata)
        by_object = {}
        for first, md in groups(md_all, FA_METADATA).items():
            static = dataclasses.replace(
                md, num_actual_tokens=size, max_query_len=size, max_seq_len=self.max_len,
                query_start_loc=md.query_start_loc.clone(), seq_lens=md.seq_lens.clone(),
                block_table=md.block_table.clone(), slot_mapping=static_slots(md.slot_mapping, size),
                scheduler_metadata=None)
            self.attn[first] = by_object[id(md)] = static
        for md in groups(md_all, GDN_METADATA).values():
            # vLLM's GDN op slices its rows and runs the gated norm on ``num_actual_tokens`` rows: a graph
            # captured with the real count would leave the rows after it out of every later, longer step
            by_object[id(md)] = dataclasses.replace(md, num_prefill_tokens=size, num_actual_tokens=size)
        md_all = {layer: by_object.get(id(md), md) for layer, md in md_all.items()}
        by_memory: dict[tuple, tuple[torch.Tensor, list[str]]] = {}
        for layer, t in (ctx.slot_mapping or {}).items():
            key = (t.data_ptr(), tuple(t.shape), t.stride())
            if key not in by_memory:
                by_memory[key] = (static_slots(t, size), [])
            by_memory[key][1].append(layer)
        self.slot_groups = list(by_memory.values())
        slots = {layer: static for static, layers in self.slot_groups for layer in layers}
        self.gdn.inline_sources.clear()
        for first, md in groups(md_all, GDN_METADATA).items():
            source = (md.prefill_state_indices[:1].clone(), md.prefill_has_initial_state[:1].clone())
            self.lines[first] = self.gdn.inline_sources[id(md)] = source
        return md_all, slots

    def write_nothing(self) -> None:
        """Point the static inputs at no state: no KV writes (slot -1) and the GDN scratch line without an
        initial state. The capture runs the forward twice; with the step's own state line, a sequence
        that continues from a state (a later chunk, a cache hit) would advance that state twice."""
        for static in self.attn.values():
            static.slot_mapping.fill_(-1)
        for static, _ in self.slot_groups:
            static.fill_(-1)
        for line, flag in self.lines.values():
            line.fill_(SCRATCH_LINE)
            flag.fill_(False)

    def capture(self, ctx, input_ids: torch.Tensor, positions: torch.Tensor, n: int,
                forward: Callable[..., torch.Tensor], pool, none_mode) -> None:
        """Capture ``forward(ids, positions)`` on static copies of this step's inputs (writing no state:
        :meth:`write_nothing`). ``none_mode``: vLLM's NONE runtime mode (its piecewise wrappers then run
        their code, which is captured here)."""
        saved = (ctx.attn_metadata, ctx.slot_mapping, ctx.cudagraph_runtime_mode)
        try:
            ctx.attn_metadata, ctx.slot_mapping = self.statics(ctx, input_ids, positions)
            self.write_nothing()
            ctx.cudagraph_runtime_mode = none_mode
            self.gdn.inline = True
            self._bucket(n).set_length(n)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward(self.ids, self.pos)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            t0 = time.perf_counter()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.out = forward(self.ids, self.pos)
            self.graph, self.captured_at, self.capture_s = graph, n, round(time.perf_counter() - t0, 3)
        finally:
            ctx.attn_metadata, ctx.slot_mapping, ctx.cudagraph_runtime_mode = saved
            self.gdn.inline = False
            self.gdn.inline_sources.clear()
            self.forget()

    def feed(self, ctx, input_ids: torch.Tensor, positions: torch.Tensor, n: int) -> None:
        """Refresh the static inputs from this step and point the GDN bucket's mask at ``n`` real rows."""
        pairs = [(self.ids, input_ids), (self.pos, positions)]
        for first, static in self.attn.items():
            md = ctx.attn_metadata[first]
            if md.max_seq_len > static.max_seq_len:     # FA3 sizes its work from the captured longest sequence
                raise ValueError(f"a sequence of {md.max_seq_len} tokens is longer than the {static.max_seq_len} "
                                 "the graph was captured for")
            pairs.extend((getattr(static, name), getattr(md, name)) for name in FA_TENSORS)
        for static, layers in self.slot_groups:
            pairs.append((static, shared_slots(ctx, layers)))
        for first, (line, flag) in self.lines.items():
            md = ctx.attn_metadata[first]
            pairs += [(line, md.prefill_state_indices[:1]), (flag, md.prefill_has_initial_state[:1])]
        refresh_all(pairs)
        self._bucket(n).set_length(n)

    def part_inputs(self, ctx, input_ids: torch.Tensor, positions: torch.Tensor, index: int,
                    part: Part) -> tuple[list, list]:
        """What :meth:`feed_part` copies for the ``index``-th sequence of a split step: ``(pairs, no_write)``,
        the (static, given) pairs and the slot mappings' padded rows to point at no slot. Views only, no GPU
        work: a step checks every part's before it replays the first (a replay writes its sequence's state,
        which vLLM's path must not advance again after a later part failed)."""
        n, rows = part.tokens, slice(part.start, part.end)
        pairs = [(self.ids[:n], input_ids[rows]), (self.pos[..., :n], positions[..., rows])]
        no_write = []
        for first, static in self.attn.items():
            md = ctx.attn_metadata[first]
            pairs += [(static.seq_lens, md.seq_lens[index:index + 1]),
                      (static.block_table, md.block_table[index:index + 1]),
                      (static.slot_mapping[:n], md.slot_mapping[rows])]
            no_write.append(static.slot_mapping[n:])
        for static, layers in self.slot_groups:
            pairs.append((static[:n], shared_slots(ctx, layers)[rows]))
            no_write.append(static[n:])
        for first, (line, flag) in self.lines.items():
            md = ctx.attn_metadata[first]
            pairs += [(line, md.prefill_state_indices[index:index + 1]),
                      (flag, md.prefill_has_initial_state[index:index + 1])]
        for static, given in pairs:
            if static.shape != given.shape:
                raise ValueError(f"a step input of shape {tuple(given.shape)} does not fit its static "
                                 f"{tuple(static.shape)}")
        return pairs, no_write

    def feed_part(self, inputs: tuple[list, list], n: int) -> None:
        """Refresh the static inputs from one sequence's :meth:`part_inputs` (``n`` real rows)."""
        pairs, no_write = inputs
        for static in self.attn.values():
            static.query_start_loc[1:].fill_(n)
        for rows in no_write:
            rows.fill_(-1)
        refresh_all(pairs)
        self._bucket(n).set_length(n)

    def replay(self, ctx, input_ids: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        self.feed(ctx, input_ids, positions, n)
        return self.launch()

    def launch(self) -> torch.Tensor:
        """Replay on the static inputs as :meth:`feed` left them; the backbone's hidden states."""
        self.graph.replay()
        self.forget()
        return self.out

    def forget(self) -> None:
        """The GDN buckets' Python-side caches no longer describe their buffers (a capture or replay
        rewrote the state lines): make the next per-layer step set them again."""
        for bucket in self.gdn._buckets.values():
            bucket.length = None
            bucket.fed = None


class StepGraphRunner:
    """Captures and replays :class:`StepGraph` per padded size and kind (:func:`step_kind`); wraps nothing,
    the model's ``forward`` calls :meth:`run` first."""

    def __init__(self, gdn: GdnGraphRunner, max_len: int, sizes: Sequence[int] | None = None,
                 split_seqs: int = 0):
        self.gdn = gdn
        self.max_len = max_len
        self.sizes = tuple(sorted(set(sizes if sizes is not None else gdn.buckets)))
        #: steps of up to this many prefill sequences replay each one's graph in turn (below 2: never)
        self.split_seqs = int(split_seqs)
        self.split_steps = 0
        self.split_replays = 0
        self.stats = GraphStats()
        self._graphs: dict[tuple[int, str], StepGraph] = {}
        self._broken: dict[tuple[int, str], str] = {}   # (size, kind) -> why it keeps the per-layer graphs
        self._pool = None

    def run(self, forward: Callable[..., torch.Tensor], input_ids: torch.Tensor | None,
            positions: torch.Tensor) -> torch.Tensor | None:
        """The step's hidden states from a step graph, or ``None``: the caller runs ``forward`` itself
        (this step is not eligible, or its graph was captured in it)."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context

        if input_ids is None:
            return self._fallback("embeds")
        ctx = get_forward_context()
        size = int(input_ids.shape[0])
        reason = step_reason(ctx, self.gdn.buckets, self.gdn.min_tokens, self.sizes, size, CUDAGraphMode.PIECEWISE)
        if reason is None and torch.cuda.is_current_stream_capturing():
            reason = "capturing"
        if reason == "batch" and self.split_seqs > 1:
            return self._split(ctx, input_ids, positions)
        if reason is not None:
            return self._fallback(reason)
        key = (size, step_kind(ctx.attn_metadata, size))
        if key in self._broken:
            return self._fallback(self._broken[key])
        n = next(iter(groups(ctx.attn_metadata, GDN_METADATA).values())).num_actual_tokens
        graph = self._graphs.get(key)
        if graph is None:
            bucket = choose_bucket(n, self.gdn.buckets)
            if not self.gdn.prefixes or any((p, bucket, "core") not in self.gdn._bodies for p in self.gdn.prefixes):
                return self._fallback("gdn_uncaptured")      # this step's per-layer path captures them
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = StepGraph(self.gdn, size if key[1] == FRESH else self.max_len)
            try:
                with memory.LEDGER.taking(memory.STEP_GRAPHS):
                    graph.capture(ctx, input_ids, positions, n, forward, self._pool, CUDAGraphMode.NONE)
            except Exception as exc:  # noqa: BLE001 - a capture failure must only cost speed
                self._broken[key] = "capture_failed"
                log.warning("clef step graphs: %s capture at %d tokens failed (%s: %s); those steps use the "
                            "per-layer graphs", key[1], size, type(exc).__name__, exc)
                return self._fallback("capture_failed")
            self._graphs[key] = graph
            self.stats.captures += 1
            return None                                       # the capture's own outputs are not this step's
        try:
            graph.feed(ctx, input_ids, positions, n)
        except (ValueError, RuntimeError, KeyError) as exc:   # an input the capture did not foresee
            self._broken[key] = "inputs_changed"
            del self._graphs[key]
            log.warning("clef step graphs: a %s step at %d tokens does not fit its graph (%s: %s); those steps use "
                        "the per-layer graphs", key[1], size, type(exc).__name__, exc)
            graph.forget()
            return self._fallback("inputs_changed")
        self.stats.replays += 1
        return graph.launch()

    def split_reason(self, ctx) -> list[Part] | str:
        """The parts of a step of several prefill sequences (:func:`split_plan`), or why it keeps vLLM's
        path: host-side checks only."""
        for md in groups(ctx.attn_metadata, FA_METADATA).values():
            reason = attention_reason(md)
            if reason is not None:
                return reason
        gdn = groups(ctx.attn_metadata, GDN_METADATA)
        for md in gdn.values():
            reason = prefill_reason(md)
            if reason is not None:
                return reason
        first = next(iter(gdn.values()))
        query_start, seq_lens = first.__dict__.get(QUERY_START_CPU), first.__dict__.get(SEQ_LENS_CPU)
        if query_start is None or seq_lens is None or len(query_start) != first.num_prefills + 1 \
                or int(query_start[-1]) != first.num_actual_tokens:
            return "split_metadata"
        plan = split_plan(query_start.tolist(), seq_lens.tolist(), self.gdn.buckets, self.gdn.min_tokens,
                          self.split_seqs)
        if isinstance(plan, str):
            return plan
        for part in plan:
            key = (part.size, part.kind)
            if key in self._broken:
                return self._broken[key]
            if key not in self._graphs:
                return "split_uncaptured"          # a single-sequence step of that size and kind captures it
        return plan

    def _split(self, ctx, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The hidden states of a small batch, each sequence replayed from its own step graph (the module
        docstring), or ``None``: the caller runs vLLM's path."""
        plan = "capturing" if torch.cuda.is_current_stream_capturing() else self.split_reason(ctx)
        if isinstance(plan, str):
            return self._fallback(plan)
        graphs = [self._graphs[(part.size, part.kind)] for part in plan]
        try:
            inputs = [graph.part_inputs(ctx, input_ids, positions, i, part)
                      for i, (graph, part) in enumerate(zip(graphs, plan))]
        except (ValueError, RuntimeError, KeyError, IndexError) as exc:   # before any replay: nothing written
            if not self.stats.fallbacks["split_inputs"]:
                log.warning("clef step graphs: a step of %d sequences does not fit their graphs (%s: %s); such "
                            "steps run vLLM's path", len(plan), type(exc).__name__, exc)
            return self._fallback("split_inputs")
        out = None
        for graph, part, given in zip(graphs, plan, inputs):
            graph.feed_part(given, part.tokens)
            hidden = graph.launch()
            if out is None:
                out = hidden.new_empty((input_ids.shape[0], *hidden.shape[1:]))
            out[part.start:part.end].copy_(hidden[:part.tokens])
        if plan[-1].end < out.shape[0]:
            out[plan[-1].end:].zero_()                # vLLM's padding rows: never read, but not left undefined
        self.split_steps += 1
        self.split_replays += len(plan)
        return out

    def _fallback(self, reason: str) -> None:
        self.stats.fallbacks[reason] += 1
        return None

    def describe(self) -> dict:
        kinds = Counter(kind for _, kind in self._graphs)
        return {"sizes": list(self.sizes), "graphs": len(self._graphs), "fresh_graphs": kinds[FRESH],
                "context_graphs": kinds[CONTEXT], "replays": self.stats.replays, "split_seqs": self.split_seqs,
                "split_steps": self.split_steps, "split_replays": self.split_replays,
                "captures": self.stats.captures, "fallbacks": dict(self.stats.fallbacks)}

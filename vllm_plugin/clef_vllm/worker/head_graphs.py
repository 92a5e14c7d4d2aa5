"""Plugin-owned CUDA graphs for the joint head of a step that finishes ONE request.

Why: the head's decision (:meth:`JointSchemaHead.decide`: 2 evidence layers, 4 decoder layers,
the scorers; ~200 small kernels) runs after the backbone, when the GPU has nothing else queued.
Launched one by one from Python its kernels leave the GPU idle most of the time: in vLLM's step
for one 400-token request on the H200 the head's kernels kept the GPU busy 0.8 ms of an 11.7 ms
(profiled) stretch. Replaying them from a graph costs one launch.

What: a step that finishes exactly one request (an interactive decision; every step at c=1)
copies that request's decision inputs into static buffers padded to a *bucket* (fields, options,
memory rows), replays the graph captured for the bucket and takes the first ``N`` probabilities.
Everything before (span means, lexical rows, the index upload) stays as it is; a step finishing
several requests and a schema or a memory longer than the largest bucket run the eager head, and
after a capture fails every step does (logged once).

Padding is exact in the math (and, in floating point, at the level of the kernels' shapes):

* padded option rows sit in a field of their own (the bucket's last field slot, never a real one),
  so no real field's softmax or option pooling sees them; option queries attend to the memory
  only, so padded options change no real option's routing;
* padded field slots are masked as keys of the fields' self-attention (``field_padding``); the
  memory rows past the request's length are masked as keys of every memory attention;
* padded rows hold zeros or an earlier request's finite values, never NaN.

See docs/latency.md ("Head graphs").
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Sequence

import torch

from clef_vllm.head import DecisionBatch, FieldLayout, JointSchemaHead
from clef_vllm.worker.prefill_graphs import GraphStats, capture_graph

log = logging.getLogger("clef_vllm")

#: (field slots, option slots) a single-record decision can be padded to. A bucket always keeps
#: one field slot free: the padded options' field.
SCHEMA_BUCKETS = ((4, 16), (8, 32), (16, 64), (32, 128), (65, 256))
#: Memory rows (the request's prompt length) a decision can be padded to.
MEMORY_BUCKETS = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)


def choose_schema(num_fields: int, num_options: int,
                  buckets: Sequence[tuple[int, int]] = SCHEMA_BUCKETS) -> tuple[int, int] | None:
    """The smallest schema bucket with a spare field slot for ``num_fields`` fields and room for
    ``num_options`` options, or ``None``."""
    for fields_, options in buckets:
        if num_fields < fields_ and num_options <= options:
            return fields_, options
    return None


def choose_memory(length: int, buckets: Sequence[int] = MEMORY_BUCKETS) -> int | None:
    """The smallest memory bucket holding ``length`` rows, or ``None``."""
    i = bisect.bisect_left(buckets, length)
    return buckets[i] if i < len(buckets) else None


class StaticInputs:
    """The static input buffers of every head graph, at the largest bucket; a bucket's graph reads
    leading views of them. Inputs start as zeros (finite padding from the first replay on)."""

    def __init__(self, hidden: int, width: int, max_fields: int, max_options: int, max_memory: int,
                 dtype: torch.dtype, device):
        kw = dict(dtype=dtype, device=device)
        self.memory = torch.zeros(max_memory, width, **kw)
        self.last_state = torch.zeros(1, hidden, **kw)
        self.questions = torch.zeros(max_fields, hidden, **kw)
        self.contexts = torch.zeros(max_options, hidden, **kw)
        self.lexical = torch.zeros(max_options, hidden, **kw)
        ints = dict(dtype=torch.long, device=device)
        self.type_ids = torch.zeros(max_fields, **ints)
        self.option_field = torch.zeros(max_options, **ints)
        self.lengths = torch.zeros(2, **ints)                       # [memory rows, fields] of the request
        self.positions = torch.arange(max(max_fields, max_options, max_memory), **ints)
        self.zeros = torch.zeros(max(max_fields, max_options), **ints)

    def batch(self, fields_: int, options: int, memory: int) -> DecisionBatch:
        """The padded decision batch of one bucket, as views of the buffers (masks computed from
        ``lengths`` on the device, so a graph recomputes them at every replay)."""
        layout = FieldLayout(type_ids=self.type_ids[:fields_], field_record=self.zeros[:fields_],
                             field_slot=self.positions[:fields_], option_field=self.option_field[:options],
                             option_record=self.zeros[:options], option_slot=self.positions[:options],
                             num_records=1, max_fields=fields_, max_options=options)
        return DecisionBatch(memory=self.memory[:memory].unsqueeze(0),
                             memory_padding=(self.positions[:memory] >= self.lengths[0]).unsqueeze(0),
                             last_state=self.last_state, question_state=self.questions[:fields_],
                             option_context=self.contexts[:options], option_lexical=self.lexical[:options],
                             layout=layout, field_padding=(self.positions[:fields_] >= self.lengths[1]).unsqueeze(0))

    def fill(self, batch: DecisionBatch, fields_: int, options: int) -> None:
        """Copy one real single-record ``batch`` into the buffers (no host synchronisation)."""
        lay = batch.layout
        q, n = len(lay.type_ids), len(lay.option_field)
        length = batch.memory.shape[1]
        self.memory[:length].copy_(batch.memory[0])
        self.last_state.copy_(batch.last_state)
        self.questions[:q].copy_(batch.question_state)
        self.contexts[:n].copy_(batch.option_context)
        self.lexical[:n].copy_(batch.option_lexical)
        self.type_ids[:q].copy_(lay.type_ids)
        self.option_field[:n].copy_(lay.option_field)
        self.option_field[n:options].fill_(fields_ - 1)             # padded options: the spare field
        self.lengths[0].fill_(length)
        self.lengths[1].fill_(q)


def padded_probabilities(head: JointSchemaHead, inputs: StaticInputs, fields_: int, options: int,
                         memory: int) -> torch.Tensor:
    """The graph body: per-option probabilities ``[options]`` of the padded batch of one bucket."""
    batch = inputs.batch(fields_, options, memory)
    return head.probabilities(head.decide(batch), batch.layout)


#: The captured graphs must answer the first decision within this of the eager head (max |dp|), or
#: they are dropped. Rounding between the two is far smaller (bf16 shapes: a few 0.01 on a random
#: head with logit scale 100); a graph reading a wrong buffer is not.
SELF_CHECK_TOLERANCE = 0.2


class HeadGraphRunner:
    """Owns the head's graphs, one per (schema bucket, memory bucket), all captured at the first
    decision it is given (in a server: the warm-up's first prompt, before traffic arrives), so the
    graphs' memory is taken once, up front, and no client request pays for a capture. That first
    decision is also answered eagerly and compared (:data:`SELF_CHECK_TOLERANCE`): graphs that
    disagree are never used."""

    #: The device type whose decisions use graphs (tests drive the runner on the CPU with a stand-in graph).
    device_type = "cuda"

    def __init__(self, head: JointSchemaHead, *, max_memory: int | None = None,
                 schema_buckets: Sequence[tuple[int, int]] = SCHEMA_BUCKETS,
                 memory_buckets: Sequence[int] = MEMORY_BUCKETS):
        self.head = head
        self.schema_buckets = tuple(schema_buckets)
        self.memory_buckets = tuple(b for b in memory_buckets if max_memory is None or b <= max_memory
                                    ) or tuple(memory_buckets[:1])
        self.stats = GraphStats()
        self._inputs: StaticInputs | None = None
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._failed = False        # a capture failed: every decision runs the eager head from then on
        self._pool = None

    def decide(self, batch: DecisionBatch) -> torch.Tensor | None:
        """Probabilities ``[N]`` of a single-record ``batch`` from a graph; ``None``: run the eager head."""
        lay = batch.layout
        if lay.num_records != 1:
            return self._fallback("batch")
        schema = choose_schema(len(lay.type_ids), len(lay.option_field), self.schema_buckets)
        if schema is None:
            return self._fallback("schema")
        memory = choose_memory(batch.memory.shape[1], self.memory_buckets)
        if memory is None:
            return self._fallback("memory")
        if batch.memory.device.type != self.device_type:
            return self._fallback("not_cuda")
        if batch.memory.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return self._fallback("capturing")
        if self._failed:
            return self._fallback("capture_failed")
        if not self._graphs:
            self._capture_all(batch, schema, memory)
            if self._failed:
                return self._fallback("capture_failed")
        return self._replay(batch, schema, memory)

    def _replay(self, batch: DecisionBatch, schema: tuple[int, int], memory: int) -> torch.Tensor:
        graph, out = self._graphs[(*schema, memory)]
        self._inputs.fill(batch, *schema)
        graph.replay()
        self.stats.replays += 1
        return out[:len(batch.layout.option_field)].clone()

    def _fallback(self, reason: str) -> None:
        self.stats.fallbacks[reason] += 1
        return None

    def _capture_all(self, like: DecisionBatch, schema: tuple[int, int], memory: int) -> None:
        """Capture every bucket's graph, then check the graph of ``like``'s bucket against the eager head."""
        cfg = self.head.config
        self._inputs = StaticInputs(cfg.hidden_size, cfg.width, max(f for f, _ in self.schema_buckets),
                                    max(n for _, n in self.schema_buckets), self.memory_buckets[-1],
                                    self.head.dtype, like.memory.device)
        t0 = time.perf_counter()
        for rows in reversed(self.memory_buckets):          # the largest first: it sizes the shared pool
            for fields_, options in self.schema_buckets:
                try:
                    self._graphs[(fields_, options, rows)] = self._capture(fields_, options, rows)
                    self.stats.captures += 1
                except Exception as exc:  # noqa: BLE001 - a capture failure must only cost speed
                    # A failed capture leaves its memory pool unusable for later captures (the caching
                    # allocator asserts): give up on head graphs altogether, not just on this bucket.
                    self._give_up("capture for %d fields, %d options, %d memory rows failed (%s: %s)",
                                  fields_, options, rows, type(exc).__name__, exc)
                    return
        seconds = time.perf_counter() - t0
        eager = self.head.probabilities(self.head.decide(like), like.layout)
        graph = self._replay(like, schema, memory)
        diff = float((graph - eager).abs().max()) if bool(torch.isfinite(graph).all()) else float("inf")
        if not diff <= SELF_CHECK_TOLERANCE:
            self._give_up("the first decision from a graph differs from the eager head by %.3g (allowed %g)",
                          diff, SELF_CHECK_TOLERANCE)
            return
        log.info("clef head graphs: %d graphs captured in %.2f s (memory buckets up to %d rows, schema buckets "
                 "up to %d fields / %d options); the first decision agrees with the eager head to %.2g",
                 len(self._graphs), seconds, self.memory_buckets[-1], self.schema_buckets[-1][0] - 1,
                 self.schema_buckets[-1][1], diff)

    def _give_up(self, why: str, *args) -> None:
        self._failed = True
        self._graphs.clear()
        self._pool = self._inputs = None
        log.warning("clef head graphs: " + why + "; the joint head runs eagerly from now on", *args)

    def _capture(self, fields_: int, options: int, memory: int):
        inputs = self._inputs
        inputs.lengths[0].fill_(memory)
        inputs.lengths[1].fill_(fields_ - 1)
        inputs.option_field[:options].fill_(fields_ - 1)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_graph(lambda: padded_probabilities(self.head, inputs, fields_, options, memory), self._pool)

    def describe(self) -> dict:
        return {"graphs": len(self._graphs), "replays": self.stats.replays, "captures": self.stats.captures,
                "failed": self._failed, "fallbacks": dict(self.stats.fallbacks)}

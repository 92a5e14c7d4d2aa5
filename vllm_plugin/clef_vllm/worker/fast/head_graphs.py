"""Plugin-owned CUDA graphs for the joint head of a step that finishes one request, or a few.

Why: the head's decision (:meth:`JointSchemaHead.decide`: 2 evidence layers, 4 decoder layers,
the scorers; ~200 small kernels) runs after the backbone, when the GPU has nothing else queued.
Launched one by one from Python its kernels leave the GPU idle most of the time: in vLLM's step
for one 400-token request on the H200 the head's kernels kept the GPU busy 0.8 ms of an 11.7 ms
(profiled) stretch. Replaying them from a graph costs one launch.

What: a step that finishes ``R`` requests (``R`` up to the largest *record bucket*:
``--head-graph-records``, 16 by default, up to 64) copies their decision inputs into static buffers
padded to a *bucket* (records, field and option slots per record, memory rows per record), replays the graph
captured for the bucket and gathers the real options' probabilities. Everything before (span means,
lexical rows, the index upload) stays as it is. A step finishing more requests than the largest
record bucket, a schema or a memory longer than the largest bucket (for several records: the short
decisions' buckets only, :data:`SEVERAL_SCHEMA_LIMIT`, :func:`several_memory_limit`) runs the eager
head, and after a capture fails or a self-check disagrees every step does (logged once).

Padding is exact in the math (and, in floating point, at the level of the kernels' shapes):

* each record's padded option slots sit in a field of their own (the record's last field slot,
  never a real one), so no real field's softmax or option pooling sees them; option queries attend
  to their record's memory only, so padded options change no real option's routing;
* padded field slots are masked as keys of the fields' self-attention (``field_padding``); the
  memory rows past a record's length are masked as keys of every memory attention;
* a padded record (a slot past the step's last request) keeps one unmasked memory row and one
  unmasked field slot, so none of its attentions is over an empty key set; nothing of it reaches a
  real record (every attention is within one record) or the answer (only real options are gathered);
* padded rows hold zeros or an earlier request's finite values, never NaN.

See docs/latency.md ("Head graphs").
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from clef_vllm.contract import HEAD_GRAPH_RECORDS
from clef_vllm.model.head import DecisionBatch, FieldLayout, JointSchemaHead
from clef_vllm.worker import memory
from clef_vllm.worker.fast.prefill_graphs import GraphStats, capture_graph, choose_bucket

log = logging.getLogger("clef_vllm")

#: (field slots, option slots) a single-record decision can be padded to. A bucket always keeps
#: one field slot free: the padded options' field.
SCHEMA_BUCKETS = ((4, 16), (8, 32), (16, 64), (32, 128), (65, 256))
#: Memory rows (the request's prompt length) a decision can be padded to.
MEMORY_BUCKETS = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
#: Finishing requests a step can be padded to (``--head-graph-records`` picks the largest in use).
RECORD_BUCKETS = HEAD_GRAPH_RECORDS
#: With several records per graph only short decisions are graphed: schema buckets up to this one and
#: memory buckets up to this many rows per record, and at most :data:`SEVERAL_ROWS` rows in all (as
#: many as the largest single-record graph at a 32k context): 2,048 rows per record up to 16 records,
#: 1,024 at 32, 512 at 64.
SEVERAL_SCHEMA_LIMIT = (16, 64)
SEVERAL_MEMORY_LIMIT = 2048
SEVERAL_ROWS = 32768


def several_memory_limit(records: int) -> int:
    """Memory rows per record a graph of ``records`` (> 1) records holds at most."""
    return min(SEVERAL_MEMORY_LIMIT, SEVERAL_ROWS // records)


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
    return choose_bucket(length, buckets)


def record_buckets(max_records: int) -> tuple[int, ...]:
    """The record buckets in use when steps finishing up to ``max_records`` requests are graphed."""
    return tuple(r for r in RECORD_BUCKETS if r <= max_records) or (1,)


def graph_buckets(records: Sequence[int], schemas: Sequence[tuple[int, int]],
                  memories: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Every (records, fields, options, memory rows) bucket a runner captures: all schema and memory
    buckets for one record, the short decisions' ones for several."""
    out = []
    for r in records:
        for fields_, options in schemas:
            if r > 1 and (fields_, options) > SEVERAL_SCHEMA_LIMIT:
                continue
            out.extend((r, fields_, options, m) for m in memories if r == 1 or m <= several_memory_limit(r))
    return out


class StaticInputs:
    """The static input buffers of every head graph, sized for the largest bucket of each kind; a
    bucket's graph reads leading views of them (record ``r``'s field slots are ``r*F ... r*F+F-1``,
    its option slots ``r*O ...``, its memory rows ``r*L ...`` of the flat memory). Inputs start as
    zeros (finite padding from the first replay on)."""

    def __init__(self, hidden: int, width: int, buckets: Sequence[tuple[int, int, int, int]],
                 dtype: torch.dtype, device):
        records = max(b[0] for b in buckets)
        field_slots = max(r * f for r, f, _, _ in buckets)
        option_slots = max(r * o for r, _, o, _ in buckets)
        rows = max(r * m for r, _, _, m in buckets)
        kw = dict(dtype=dtype, device=device)
        self.memory = torch.zeros(rows, width, **kw)
        self.last_state = torch.zeros(records, hidden, **kw)
        self.questions = torch.zeros(field_slots, hidden, **kw)
        self.contexts = torch.zeros(option_slots, hidden, **kw)
        self.lexical = torch.zeros(option_slots, hidden, **kw)
        ints = dict(dtype=torch.long, device=device)
        self.type_ids = torch.zeros(field_slots, **ints)
        self.option_field = torch.zeros(option_slots, **ints)
        self.memory_lengths = torch.ones(records, **ints)           # per record: memory rows
        self.field_lengths = torch.ones(records, **ints)            # per record: fields
        self.positions = torch.arange(max(field_slots, option_slots, max(b[3] for b in buckets)), **ints)

    def batch(self, records: int, fields_: int, options: int, memory: int) -> DecisionBatch:
        """The padded decision batch of one bucket, as views of the buffers (slot indices and masks
        computed on the device from ``positions`` and the lengths, so a graph recomputes them at every
        replay)."""
        field_slots, option_slots = self.positions[:records * fields_], self.positions[:records * options]
        layout = FieldLayout(type_ids=self.type_ids[:records * fields_], field_record=field_slots // fields_,
                             field_slot=field_slots % fields_, option_field=self.option_field[:records * options],
                             option_record=option_slots // options, option_slot=option_slots % options,
                             num_records=records, max_fields=fields_, max_options=options)
        rows = self.positions[:memory][None, :]
        return DecisionBatch(memory=self.memory[:records * memory].view(records, memory, -1),
                             memory_padding=rows >= self.memory_lengths[:records, None],
                             last_state=self.last_state[:records], question_state=self.questions[:records * fields_],
                             option_context=self.contexts[:records * options],
                             option_lexical=self.lexical[:records * options], layout=layout,
                             field_padding=self.positions[:fields_][None, :] >= self.field_lengths[:records, None])

    def fill(self, batch: DecisionBatch, records: int, fields_: int, options: int, memory: int) -> torch.Tensor:
        """Copy a real ``batch`` (its records first, the rest padding) into the buffers of a bucket, without
        host synchronisation; returns the real options' slots (gather the answer's probabilities with it)."""
        lay = batch.layout
        real, length = lay.num_records, batch.memory.shape[1]
        field_pos = lay.field_record * fields_ + lay.field_slot
        option_pos = lay.option_record * options + lay.option_slot
        self.type_ids.index_copy_(0, field_pos, lay.type_ids)
        self.questions.index_copy_(0, field_pos, batch.question_state)
        self.contexts.index_copy_(0, option_pos, batch.option_context)
        self.lexical.index_copy_(0, option_pos, batch.option_lexical)
        spare = self.positions[:records * options] // options * fields_ + (fields_ - 1)   # each record's spare field
        self.option_field[:records * options].copy_(spare)
        self.option_field.index_copy_(0, option_pos, field_pos[lay.option_field])
        self.memory[:records * memory].view(records, memory, -1)[:real, :length].copy_(batch.memory)
        self.last_state[:real].copy_(batch.last_state)
        self.memory_lengths[:records].fill_(1)          # a padded record: one (stale, finite) row, one field
        if batch.memory_padding is None:
            self.memory_lengths[:real].fill_(length)
        else:
            self.memory_lengths[:real].copy_((~batch.memory_padding).sum(1))
        self.field_lengths[:records].fill_(1)
        self.field_lengths[:real].zero_().index_add_(0, lay.field_record, torch.ones_like(lay.field_record))
        return option_pos


def repeat_first_record(batch: DecisionBatch, copies: int) -> DecisionBatch:
    """A batch of ``copies`` records, each a copy of ``batch``'s first record (its memory rows without
    padding, its fields and options): a real decision of any record count, for checking a record
    bucket's graphs before a step of that many requests arrives. Reads the layout on the host."""
    lay = batch.layout
    field_record, option_field = lay.field_record.cpu(), lay.option_field.cpu()
    n_fields = int((field_record == 0).sum())
    counts = torch.bincount(option_field, minlength=n_fields)[:n_fields].tolist()
    n_options = sum(counts)
    length = batch.memory.shape[1] if batch.memory_padding is None else int((~batch.memory_padding[0]).sum())
    layout = FieldLayout.from_records([(lay.type_ids[:n_fields].tolist(), counts)] * copies)
    rows = lambda t, n: t[:n].repeat(copies, *([1] * (t.dim() - 1)))  # noqa: E731
    return DecisionBatch(memory=batch.memory[:1, :length].expand(copies, -1, -1).contiguous(), memory_padding=None,
                         last_state=rows(batch.last_state, 1), question_state=rows(batch.question_state, n_fields),
                         option_context=rows(batch.option_context, n_options),
                         option_lexical=rows(batch.option_lexical, n_options), layout=layout.to(batch.memory.device))


def padded_probabilities(head: JointSchemaHead, inputs: StaticInputs, records: int, fields_: int, options: int,
                         memory: int) -> torch.Tensor:
    """The graph body: per-option-slot probabilities ``[records * options]`` of one bucket's padded batch."""
    batch = inputs.batch(records, fields_, options, memory)
    return head.probabilities(head.decide(batch), batch.layout)


#: The captured graphs must answer the first decision within this of the eager head (max |dp|), or
#: they are dropped. Rounding between the two is far smaller (bf16 shapes: a few 0.01 on a random
#: head with logit scale 100); a graph reading a wrong buffer is not.
SELF_CHECK_TOLERANCE = 0.2


class HeadGraphRunner:
    """Owns the head's graphs, one per bucket (:func:`graph_buckets`), all captured at the first decision
    it is given (in a server: the warm-up's first prompt, before traffic arrives), so the graphs' memory
    is taken once, up front, and no client request pays for a capture. Each record bucket's graphs are
    checked once against the eager head (:data:`SELF_CHECK_TOLERANCE`): graphs that disagree are never
    used again. The checks run at that same first decision too, on copies of its first record (the
    fewest that fill each record bucket), so no client request pays for one either (a first eager head
    of 14 records held a tiny server's step for 0.5 s); a record bucket that decision cannot fill
    within the several-record limits is checked at its own first decision."""

    #: The device type whose decisions use graphs (tests drive the runner on the CPU with a stand-in graph).
    device_type = "cuda"

    def __init__(self, head: JointSchemaHead, *, max_memory: int | None = None, max_records: int = 1,
                 schema_buckets: Sequence[tuple[int, int]] = SCHEMA_BUCKETS,
                 memory_buckets: Sequence[int] = MEMORY_BUCKETS):
        self.head = head
        self.schema_buckets = tuple(schema_buckets)
        self.memory_buckets = tuple(b for b in memory_buckets if max_memory is None or b <= max_memory
                                    ) or tuple(memory_buckets[:1])
        self.record_buckets = record_buckets(max_records)
        self.buckets = graph_buckets(self.record_buckets, self.schema_buckets, self.memory_buckets)
        self.stats = GraphStats()
        self._inputs: StaticInputs | None = None
        self._graphs: dict[tuple[int, int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._checked: set[int] = set()     # record buckets whose first decision matched the eager head
        self._failed = False        # a capture failed or a check disagreed: the eager head from then on
        self._pool = None

    def choose(self, batch: DecisionBatch) -> tuple[int, int, int, int] | str:
        """The bucket of ``batch``, or why it has none."""
        lay = batch.layout
        records = choose_bucket(lay.num_records, self.record_buckets)
        if records is None:
            return "records"
        schema = choose_schema(lay.max_fields, lay.max_options, self.schema_buckets)
        if schema is None or (records > 1 and schema > SEVERAL_SCHEMA_LIMIT):
            return "schema"
        memory = choose_memory(batch.memory.shape[1], self.memory_buckets)
        if memory is None or (records > 1 and memory > several_memory_limit(records)):
            return "memory"
        return (records, *schema, memory)

    def decide(self, batch: DecisionBatch) -> torch.Tensor | None:
        """Probabilities ``[N]`` of ``batch``'s options (records concatenated) from a graph; ``None``: run
        the eager head."""
        bucket = self.choose(batch)
        if isinstance(bucket, str):
            return self._fallback(bucket)
        if batch.memory.device.type != self.device_type:
            return self._fallback("not_cuda")
        if batch.memory.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return self._fallback("capturing")
        if not self._failed and not self._graphs:
            self._capture_all(batch.memory.device)
            if not self._failed:            # a capture that failed (out of memory under the budget) left no graphs
                self._check_all(batch)
        if not self._failed and bucket[0] not in self._checked:
            self._self_check(batch, bucket)
        if self._failed:
            return self._fallback("capture_failed")
        return self._replay(batch, bucket)

    def _replay(self, batch: DecisionBatch, bucket: tuple[int, int, int, int]) -> torch.Tensor:
        graph, out = self._graphs[bucket]
        real = self._inputs.fill(batch, *bucket)
        graph.replay()
        self.stats.replays += 1
        return out.index_select(0, real)

    def _fallback(self, reason: str) -> None:
        self.stats.fallbacks[reason] += 1
        return None

    def _capture_all(self, device) -> None:
        """Capture every bucket's graph, the largest memories first (they size the shared pool)."""
        with memory.LEDGER.taking(memory.HEAD_GRAPHS):
            self._capture_buckets(device)

    def _capture_buckets(self, device) -> None:
        cfg = self.head.config
        self._inputs = StaticInputs(cfg.hidden_size, cfg.width, self.buckets, self.head.dtype, device)
        t0 = time.perf_counter()
        for bucket in sorted(self.buckets, key=lambda b: (b[0] * b[3], b), reverse=True):
            try:
                self._graphs[bucket] = self._capture(*bucket)
                self.stats.captures += 1
            except Exception as exc:  # noqa: BLE001 - a capture failure must only cost speed
                # A failed capture leaves its memory pool unusable for later captures (the caching
                # allocator asserts): give up on head graphs altogether, not just on this bucket.
                self._give_up("capture for %d record(s), %d fields, %d options, %d memory rows failed (%s: %s)",
                              *bucket, type(exc).__name__, exc)
                return
        log.info("clef head graphs: %d graphs captured in %.2f s (steps finishing up to %d request(s); memory "
                 "buckets up to %d rows, schema buckets up to %d fields / %d options)", len(self._graphs),
                 time.perf_counter() - t0, self.record_buckets[-1], self.memory_buckets[-1],
                 self.schema_buckets[-1][0] - 1, self.schema_buckets[-1][1])

    def _check_all(self, first: DecisionBatch) -> None:
        """Check every record bucket on copies of ``first``'s first record (see the class docstring)."""
        low, checked, worst = 0, [], 0.0
        for records in self.record_buckets:
            copies, low = low + 1, records      # the fewest records that land in this bucket: the most padding
            batch = repeat_first_record(first, copies)
            bucket = self.choose(batch)
            if isinstance(bucket, str):
                continue
            diff = self._self_check(batch, bucket, quiet=True)
            if diff is None:
                return
            checked.append(records)
            worst = max(worst, diff)
        if checked:
            log.info("clef head graphs: graphs of %s record(s) agree with the eager head to %.2g (copies of the first "
                     "decision's record)", ", ".join(map(str, checked)), worst)

    def _self_check(self, batch: DecisionBatch, bucket: tuple[int, int, int, int], quiet: bool = False
                    ) -> float | None:
        """Answer ``batch`` eagerly too; drop every graph if the two differ. Returns the difference, or
        ``None`` when they disagreed."""
        eager = self.head.probabilities(self.head.decide(batch), batch.layout)
        graph = self._replay(batch, bucket)
        diff = float((graph - eager).abs().max()) if bool(torch.isfinite(graph).all()) else float("inf")
        if not diff <= SELF_CHECK_TOLERANCE:
            self._give_up("a decision of %d record(s) from a graph differs from the eager head by %.3g "
                          "(allowed %g)", batch.layout.num_records, diff, SELF_CHECK_TOLERANCE)
            return None
        self._checked.add(bucket[0])
        if not quiet:
            log.info("clef head graphs: the first decision of %d record(s) agrees with the eager head to %.2g",
                     batch.layout.num_records, diff)
        return diff

    def _give_up(self, why: str, *args) -> None:
        self._failed = True
        self._graphs.clear()
        self._pool = self._inputs = None
        log.warning("clef head graphs: " + why + "; the joint head runs eagerly from now on", *args)

    def _capture(self, records: int, fields_: int, options: int, memory: int):
        inputs = self._inputs
        inputs.memory_lengths[:records].fill_(memory)
        inputs.field_lengths[:records].fill_(fields_ - 1)
        inputs.option_field[:records * options].copy_(
            inputs.positions[:records * options] // options * fields_ + (fields_ - 1))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_graph(lambda: padded_probabilities(self.head, inputs, records, fields_, options, memory),
                             self._pool)

    def describe(self) -> dict:
        return {"graphs": len(self._graphs), "replays": self.stats.replays, "captures": self.stats.captures,
                "failed": self._failed, "fallbacks": dict(self.stats.fallbacks)}

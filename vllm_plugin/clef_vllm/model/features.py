"""From hidden states to head inputs, chunk by chunk — shared by the reference backend and the vLLM pooler.

A record's :class:`HeadSpec` says where its question and option spans are. A
:class:`RecordAccumulator` absorbs that record's hidden states in one or more chunks (chunked
prefill delivers them in pieces) and keeps only what the head needs: the [L, D] memory
projection, fp32 sums over every span, and the normalised state of the last token. Raw
[L, H] hidden states are never kept. :func:`decide_records` then runs the head once for a batch
of finished records.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from clef_vllm.model.head import DecisionBatch, FieldLayout, JointSchemaHead, ranks_within, segment_sum, span_positions
from clef_vllm.model.tables import LexicalTable
from clef_vllm.schema.state_keys import KEY_UNIT, prefix_keys


@dataclass(frozen=True)
class HeadSpec:
    """What the head needs about one record besides its hidden states. Plain ints: it crosses IPC."""

    num_tokens: int
    type_ids: tuple[int, ...]
    question_spans: tuple[tuple[int, int], ...]
    option_spans: tuple[tuple[int, int], ...]      # flat, field by field, encoded option order
    options_per_field: tuple[int, ...]
    lexical_ids: tuple[int, ...]                   # token ids inside the option spans, in order
    # State cache (optional): positions before ``reuse_limit`` (the first span) may come from the
    # cache; ``state_keys`` are the content keys of that prefix (clef_vllm.worker.fast.state_cache).
    reuse_limit: int = 0
    state_keys: tuple[bytes, ...] = ()

    @classmethod
    def from_encoded(cls, encoded, state_keys: bool = False, upto: int | None = None) -> "HeadSpec":
        """The spec of an encoded request; ``state_keys``: also key its reusable prefix (state cache): the tokens
        before its first span, or its first ``upto`` tokens (where its prefill stops and its state is kept)."""
        f = encoded.fields
        spec = cls(
            num_tokens=encoded.num_tokens,
            type_ids=tuple(x.type_id for x in f),
            question_spans=tuple(x.question_span for x in f),
            option_spans=tuple(s for x in f for s in x.option_spans),
            options_per_field=tuple(len(x.option_spans) for x in f),
            lexical_ids=tuple(encoded.lexical_ids),
        )
        if not state_keys:
            return spec
        limit = spec.first_span_start if upto is None else min(upto, spec.first_span_start)
        return spec.with_reuse(encoded.input_ids, limit, media=encoded.media_digest)

    def with_reuse(self, token_ids, limit: int, media: bytes = b"") -> "HeadSpec":
        """This spec with its first ``limit`` tokens (``token_ids[:limit]``) keyed as a reusable state (``media``:
        the digest of the prompt's images, part of every key)."""
        return replace(self, reuse_limit=limit, state_keys=tuple(prefix_keys(token_ids, limit, media=media)))

    @property
    def first_span_start(self) -> int:
        """Where the first question or option span begins: every earlier token only feeds the memory rows."""
        return min(a for a, _ in self.spans())

    def to_wire(self) -> dict:
        """A msgpack-friendly dict for ``PoolingParams.extra_kwargs``: every int of the spec in one
        little-endian int32 buffer (``"a"``: the token count, the field, option and lexical counts, then
        type ids, options per field, question spans, option spans, lexical ids), and with a reusable state
        its limit (``"r"``) and keys (``"k"``). vLLM deep-copies every request's parameters; a bytes object
        copies for free where lists of ints copy element by element (a short decision's parameters cost the
        front end 0.021 ms instead of 0.077: ``bench/results/cpu_pooler_host.txt``)."""
        flat = [self.num_tokens, self.num_fields, self.num_options, len(self.lexical_ids), *self.type_ids,
                *self.options_per_field, *(v for s in self.question_spans for v in s),
                *(v for s in self.option_spans for v in s), *self.lexical_ids]
        wire = {"a": struct.pack(f"<{len(flat)}i", *flat)}
        if self.reuse_limit:
            wire.update(r=self.reuse_limit, k=list(self.state_keys))
        return wire

    @classmethod
    def from_wire(cls, d: dict) -> "HeadSpec":
        """The spec :meth:`to_wire` wrote. ValueError / TypeError / KeyError for a malformed one."""
        packed = d["a"]
        if len(packed) % 4 or len(packed) < 16:
            raise ValueError(f"head spec: {len(packed)} bytes are no int32 header and body")
        ints = struct.unpack(f"<{len(packed) // 4}i", packed)
        num_tokens, fields, options, lexical = ints[:4]
        if min(fields, options, lexical) < 0 or len(ints) != 4 + 4 * fields + 2 * options + lexical:
            raise ValueError(f"head spec: {len(ints)} ints for {fields} fields, {options} options, "
                             f"{lexical} lexical ids")
        n_at, q_at = 4 + fields, 4 + 2 * fields
        o_at = q_at + 2 * fields
        x_at = o_at + 2 * options
        q, o = ints[q_at:o_at], ints[o_at:x_at]
        return cls(num_tokens, ints[4:n_at], tuple(zip(q[::2], q[1::2])), tuple(zip(o[::2], o[1::2])),
                   ints[n_at:q_at], ints[x_at:], int(d.get("r", 0)), tuple(bytes(k) for k in d.get("k", ())))

    @property
    def num_fields(self) -> int:
        return len(self.type_ids)

    @property
    def num_options(self) -> int:
        return len(self.option_spans)

    @property
    def num_segments(self) -> int:
        """Question spans first, then option spans."""
        return self.num_fields + self.num_options

    def spans(self) -> tuple[tuple[int, int], ...]:
        return self.question_spans + self.option_spans

    def token_segments(self) -> np.ndarray:
        """[L] segment index of every token; tokens outside any span map to the overflow row ``num_segments``."""
        spans = np.asarray(self.spans(), dtype=np.int64).reshape(-1, 2)
        seg = np.full(self.num_tokens, self.num_segments, dtype=np.int64)
        seg[span_positions(spans)] = np.repeat(np.arange(len(spans)), spans[:, 1] - spans[:, 0])
        return seg

    def validate(self) -> None:
        """Raise ValueError if spans are empty, overlapping or out of range (a spec from the wire)."""
        if not self.type_ids or len(self.options_per_field) != self.num_fields:
            raise ValueError("head spec: fields and option counts disagree")
        if sum(self.options_per_field) != self.num_options or min(self.options_per_field) < 1:
            raise ValueError("head spec: every field needs at least one option")
        if any(t not in (0, 1, 2) for t in self.type_ids):
            raise ValueError("head spec: unknown type id")
        covered = sorted(self.spans())
        last = 0
        for a, b in covered:
            if not (last <= a < b <= self.num_tokens):
                raise ValueError(f"head spec: bad span [{a}, {b}) for {self.num_tokens} tokens")
            last = b
        if len(self.lexical_ids) != sum(b - a for a, b in self.option_spans):
            raise ValueError("head spec: lexical ids do not match the option spans")
        if self.reuse_limit > self.first_span_start or len(self.state_keys) * KEY_UNIT > self.reuse_limit:
            raise ValueError("head spec: the reusable prefix overlaps a span")


def upload(tensors: Sequence[torch.Tensor | np.ndarray], device) -> list[torch.Tensor]:
    """Copy small int64 CPU tensors (or numpy arrays) to ``device`` in ONE pinned, non-blocking transfer.

    A copy from pageable memory synchronises the host with the GPU stream; inside vLLM's step that
    would make the CPU wait for the backbone forward before it can launch any head kernel.
    """
    tensors = [torch.from_numpy(np.ascontiguousarray(t, dtype=np.int64)) if isinstance(t, np.ndarray) else t
               for t in tensors]
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1).long() for t in tensors]).pin_memory()
    moved = flat.to(device, non_blocking=True)
    return [m.view(t.shape) for m, t in zip(moved.split([t.numel() for t in tensors]), tensors)]


class RecordAccumulator:
    """Per-record state across prefill chunks: memory chunks, fp32 span sums, last normalised state.

    Nothing here touches the GPU per record: the token -> segment map stays on the host and a
    step's index data for all its records goes to the device in one transfer (:func:`accumulate`).
    """

    def __init__(self, spec: HeadSpec):
        self.spec = spec
        self.segments = spec.token_segments()      # numpy [L]
        self.sums: torch.Tensor | None = None
        self.memory: list[torch.Tensor] = []
        self.last_state: torch.Tensor | None = None
        self.filled = 0
        self.stored = 0             # leading positions whose rows are in the state cache
        self.cached = 0             # leading positions that came from the state cache
        self.synthetic = False      # a profiling / warm-up stand-in of vLLM's, not a client's request

    @property
    def complete(self) -> bool:
        return self.filled >= self.spec.num_tokens

    def absorb(self, sums: torch.Tensor, memory: torch.Tensor, last_state: torch.Tensor, end: int) -> None:
        self.sums = sums if self.sums is None else self.sums + sums
        self.memory.append(memory)
        self.last_state = last_state
        self.filled = end

    def start_from_cache(self, rows: torch.Tensor) -> None:
        """Begin with the memory rows of a cached prefix (positions ``[0, len(rows))``, all before the
        first span, so no span sum and not the last state depends on them)."""
        if len(rows) > self.spec.first_span_start:
            raise ValueError("a cached prefix may not reach into a span")
        self.memory.append(rows)
        self.filled = len(rows)
        self.cached = len(rows)

    def memory_rows(self, start: int, end: int) -> torch.Tensor:
        """Memory rows ``[start, end)`` (already absorbed), across chunk boundaries."""
        pieces, pos = [], 0
        for chunk in self.memory:
            a, b = max(start, pos), min(end, pos + chunk.shape[0])
            if a < b:
                pieces.append(chunk[a - pos:b - pos])
            pos += chunk.shape[0]
            if pos >= end:
                break
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def accumulate(head: JointSchemaHead, hidden: torch.Tensor,
               pieces: Sequence[tuple[RecordAccumulator, int, int, int]]) -> None:
    """Feed one step's hidden states ``[T, H]`` to several records at once.

    ``pieces[i] = (accumulator, row_offset, num_rows, start_position)``: rows
    ``hidden[row_offset:row_offset+num_rows]`` are positions ``start_position...`` of that record.
    One LayerNorm, one projection, one index upload and one scatter-add serve all records of the
    step; the number of GPU kernels does not grow with the number of records. Only the rows inside a
    question or option span reach the span sums (a short decision's few dozen of its ~400; the rest only
    feed the memory rows): summing every row into an overflow row nobody reads cost a 41-request step
    0.9 ms of GPU time on an H200, the fp32 copy of all its normalised states and 67 M atomic adds
    (``bench/results/clef_bench/h200_9b_bf16_c64_grid_trace.json.gz``). A record that
    completes in this step keeps views into the step's tensors (it is decided right away); one
    that continues in a later chunk keeps copies, so a step's buffers are not held for it.
    """
    if not pieces:
        return
    states, memory = head.encode_tokens(hidden)
    seg, rows, bases, base = [], [], [], 0
    for acc, offset, n, start in pieces:
        segments = acc.segments[start:start + n]
        inside = np.flatnonzero(segments < acc.spec.num_segments)      # the overflow row is never read
        seg.append(segments[inside] + base)
        rows.append(inside + offset)
        bases.append(base)
        base += acc.spec.num_segments + 1
    seg_index, row_index = upload([np.concatenate(seg), np.concatenate(rows)], hidden.device)
    sums = segment_sum(states.index_select(0, row_index), seg_index, base)
    for (acc, off, n, start), b in zip(pieces, bases):
        done = start + n >= acc.spec.num_tokens
        mem, last = memory[off:off + n], states[off + n - 1]
        acc.absorb(sums[b:b + acc.spec.num_segments + 1], mem if done else mem.clone(),
                   last if done else last.clone(), start + n)


def step_indices(specs: Sequence[HeadSpec]) -> tuple[FieldLayout, list[np.ndarray]]:
    """The host index data of one step's finishing records: their field layout, and the lexical token
    ids, each lexical token's option, tokens per option span, the span-sum rows of the questions and of
    the options (each record's rows start after the previous record's overflow row) and tokens per
    question span. A few numpy operations whatever the numbers of records, fields, options and tokens:
    it runs in vLLM's engine core once per step, before any head kernel can be issued
    (0.5-1 ms for 40-64 records on the dev CPU: ``bench/results/cpu_pooler_host.txt``)."""
    layout = FieldLayout.from_records([(spec.type_ids, spec.options_per_field) for spec in specs])
    spans = lambda attr: np.array([ab for spec in specs for ab in getattr(spec, attr)],  # noqa: E731
                                  dtype=np.int64).reshape(-1, 2)
    option_spans, question_spans = spans("option_spans"), spans("question_spans")
    option_counts = option_spans[:, 1] - option_spans[:, 0]
    num_fields = np.array([spec.num_fields for spec in specs], dtype=np.int64)
    num_options = np.array([spec.num_options for spec in specs], dtype=np.int64)
    row_base = np.cumsum(num_fields + num_options + 1) - (num_fields + num_options + 1)
    lex_ids = np.array([i for spec in specs for i in spec.lexical_ids], dtype=np.int64)
    lex_seg = np.repeat(np.arange(option_counts.size, dtype=np.int64), option_counts)
    q_rows = np.repeat(row_base, num_fields) + ranks_within(num_fields)
    c_rows = np.repeat(row_base + num_fields, num_options) + ranks_within(num_options)
    q_len = question_spans[:, 1] - question_spans[:, 0]
    return layout, [lex_ids, lex_seg, option_counts, q_rows, c_rows, q_len]


#: Records decided together are padded to the longest memory among them. A group may pad to at most this
#: many times its real memory rows (or to :data:`PADDED_ROWS_FLOOR` rows): one long record finishing in a
#: step beside many short ones is decided apart from them, instead of padding each of them to its length
#: (41 short records beside a 16k-token one would have been 41 x 16,384 rows through every attention).
PADDING_FACTOR = 2
PADDED_ROWS_FLOOR = 4096


def padding_groups(lengths: Sequence[int], max_rows: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` (memory rows per record) in groups, longest first, each padding to at most
    ``max(PADDED_ROWS_FLOOR, PADDING_FACTOR x its real rows)`` and, with ``max_rows``, to at most that many rows
    (a record longer than that alone): the head's transient memory is then bounded by one decision of
    ``max_rows`` rows, the size the worker measures in vLLM's profiling (``--max-model-len``)."""
    groups, cur, real = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        padded = (len(cur) + 1) * lengths[cur[0]] if cur else 0
        if cur and (padded > max(PADDED_ROWS_FLOOR, PADDING_FACTOR * (real + lengths[i]))
                    or (max_rows is not None and padded > max_rows)):
            groups.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += lengths[i]
    if cur:
        groups.append(cur)
    return groups


def decide_records(head: JointSchemaHead, table: LexicalTable, records: Sequence[RecordAccumulator],
                   graphs=None, eager=None, max_rows: int | None = None) -> list[torch.Tensor]:
    """Run the head on finished records; returns per-record fp32 probabilities (encoded option order).

    Records are decided in groups of similar memory lengths (:func:`padding_groups`), so the padded
    work stays within a small factor of the real work; usually a step's records form one group.
    ``graphs`` (a :class:`clef_vllm.worker.fast.head_graphs.HeadGraphRunner`) decides a group from a
    CUDA graph when it can (one record, or up to its largest record bucket); otherwise the head runs
    eagerly, inside the context ``eager`` when given (the worker's
    :class:`~clef_vllm.worker.fast.gemm_warmup.GridRows`); ``max_rows``: as :func:`padding_groups`'.
    """
    lengths = np.array([sum(m.shape[0] for m in r.memory) for r in records], dtype=np.int64)
    groups = padding_groups(lengths.tolist(), max_rows)
    if len(groups) == 1:
        return decide_group(head, table, records, graphs, lengths, eager)
    out: list[torch.Tensor | None] = [None] * len(records)
    for group in groups:
        for i, p in zip(group, decide_group(head, table, [records[i] for i in group], graphs, lengths[group], eager)):
            out[i] = p
    return out


def decide_group(head: JointSchemaHead, table: LexicalTable, records: Sequence[RecordAccumulator],
                 graphs=None, lengths: np.ndarray | None = None, eager=None) -> list[torch.Tensor]:
    """One group of :func:`decide_records`, every record padded to the group's longest memory (``lengths``:
    the records' memory rows, when the caller has counted them; ``eager``: as there).

    All index data goes to the device in one pinned transfer and nothing here waits for the GPU,
    so the head's kernels queue behind the backbone's instead of stalling the step. Span means,
    option pooling and the padded memory batch are built with a fixed number of kernels whatever
    the number of records (flat tensors + host-built indices).
    """
    dtype = head.dtype
    device = records[0].sums.device
    cpu_layout, indices = step_indices([r.spec for r in records])
    if lengths is None:
        lengths = np.array([sum(m.shape[0] for m in r.memory) for r in records], dtype=np.int64)
    longest = int(lengths.max())
    padded = bool((lengths != longest).any())
    starts = np.arange(len(records), dtype=np.int64) * longest                   # each record's padded rows
    slots = span_positions(np.stack([starts, starts + lengths], axis=1) if padded else np.zeros((0, 2), np.int64))
    names = ("type_ids", "field_record", "field_slot", "option_field", "option_record", "option_slot")
    moved = upload([getattr(cpu_layout, n) for n in names] + indices + [lengths, slots], device)
    layout = replace(cpu_layout, **dict(zip(names, moved[:6])))
    ids, seg, counts, q_rows, c_rows, q_len, mem_len, slots = moved[6:]   # counts: option span lengths

    sums = torch.cat([r.sums for r in records])                                  # [sum(S_r + 1), H] fp32
    questions = (sums.index_select(0, q_rows) / q_len[:, None].float()).to(dtype)
    contexts = (sums.index_select(0, c_rows) / counts[:, None].float()).to(dtype)
    lexical = (segment_sum(table.rows(ids, dtype), seg, counts.shape[0]) / counts[:, None].float()).to(dtype)

    flat = torch.cat([m for r in records for m in r.memory])                     # [sum L, D]
    if padded:
        memory = flat.new_zeros(len(records) * longest, flat.shape[-1]).index_copy_(0, slots, flat)
        memory = memory.view(len(records), longest, -1)
        padding = torch.arange(longest, device=device)[None, :] >= mem_len[:, None]
    else:
        memory, padding = flat.view(len(records), longest, -1), None
    batch = DecisionBatch(memory=memory, memory_padding=padding,
                          last_state=torch.stack([r.last_state for r in records]),
                          question_state=questions, option_context=contexts,
                          option_lexical=lexical, layout=layout)
    probs = graphs.decide(batch) if graphs is not None else None
    if probs is None:
        with eager or contextlib.nullcontext():
            probs = head.probabilities(head.decide(batch), layout)
    return list(probs.split([r.spec.num_options for r in records]))


def synthetic_spec(num_tokens: int) -> HeadSpec | None:
    """A representative spec for a dummy request of ``num_tokens`` (profiling / warm-up).

    Three fields (noul, choice, score) with 2-4 options each in the last quarter of the
    prompt; ``None`` when the prompt is too short to hold any span.
    """
    options = (2, 3, 4)
    needed = sum(1 + n for n in options)  # one-token question span + one-token option spans
    if num_tokens < needed:
        if num_tokens < 2:
            return None
        return HeadSpec(num_tokens, (0,), ((0, 1),), ((1, 2),), (1,), (0,))
    pos = num_tokens - needed
    q_spans, o_spans = [], []
    for n in options:
        q_spans.append((pos, pos + 1))
        pos += 1
        for _ in range(n):
            o_spans.append((pos, pos + 1))
            pos += 1
    return HeadSpec(num_tokens, (0, 1, 2), tuple(q_spans), tuple(o_spans), options, (0,) * len(o_spans))

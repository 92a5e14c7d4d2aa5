"""From hidden states to head inputs, chunk by chunk — shared by the reference backend and the vLLM pooler.

A record's :class:`HeadSpec` says where its question and option spans are. A
:class:`RecordAccumulator` absorbs that record's hidden states in one or more chunks (chunked
prefill delivers them in pieces) and keeps only what the head needs: the [L, D] memory
projection, fp32 sums over every span, and the normalised state of the last token. Raw
[L, H] hidden states are never kept. :func:`decide_records` then runs the head once for a batch
of finished records.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from clef_vllm.head import DecisionBatch, FieldLayout, JointSchemaHead, segment_sum
from clef_vllm.tables import LexicalTable


@dataclass(frozen=True)
class HeadSpec:
    """What the head needs about one record besides its hidden states. Plain ints: it crosses IPC."""

    num_tokens: int
    type_ids: tuple[int, ...]
    question_spans: tuple[tuple[int, int], ...]
    option_spans: tuple[tuple[int, int], ...]      # flat, field by field, encoded option order
    options_per_field: tuple[int, ...]
    lexical_ids: tuple[int, ...]                   # token ids inside the option spans, in order

    @classmethod
    def from_encoded(cls, encoded) -> "HeadSpec":
        f = encoded.fields
        return cls(
            num_tokens=encoded.num_tokens,
            type_ids=tuple(x.type_id for x in f),
            question_spans=tuple(x.question_span for x in f),
            option_spans=tuple(s for x in f for s in x.option_spans),
            options_per_field=tuple(len(x.option_spans) for x in f),
            lexical_ids=tuple(encoded.lexical_ids),
        )

    def to_wire(self) -> dict:
        """A msgpack-friendly dict (lists of ints) for ``PoolingParams.extra_kwargs``."""
        return {"L": self.num_tokens, "t": list(self.type_ids), "q": [list(s) for s in self.question_spans],
                "o": [list(s) for s in self.option_spans], "n": list(self.options_per_field),
                "x": list(self.lexical_ids)}

    @classmethod
    def from_wire(cls, d: dict) -> "HeadSpec":
        return cls(int(d["L"]), tuple(d["t"]), tuple(tuple(s) for s in d["q"]), tuple(tuple(s) for s in d["o"]),
                   tuple(d["n"]), tuple(d["x"]))

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

    def token_segments(self) -> torch.Tensor:
        """[L] segment index of every token; tokens outside any span map to the overflow row ``num_segments``."""
        seg = torch.full((self.num_tokens,), self.num_segments, dtype=torch.long)
        for i, (a, b) in enumerate(self.spans()):
            seg[a:b] = i
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


def upload(tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    """Copy small int64 CPU tensors to ``device`` in ONE pinned, non-blocking transfer.

    A copy from pageable memory synchronises the host with the GPU stream; inside vLLM's step that
    would make the CPU wait for the backbone forward before it can launch any head kernel.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1).long() for t in tensors]).pin_memory()
    moved = flat.to(device, non_blocking=True)
    return [m.view(t.shape) for m, t in zip(moved.split([t.numel() for t in tensors]), tensors)]


class RecordAccumulator:
    """Per-record state across prefill chunks: memory chunks, fp32 span sums, last normalised state."""

    def __init__(self, spec: HeadSpec, device: torch.device | str):
        self.spec = spec
        self.segments = upload([spec.token_segments()], device)[0]
        self.sums: torch.Tensor | None = None
        self.memory: list[torch.Tensor] = []
        self.last_state: torch.Tensor | None = None
        self.filled = 0

    @property
    def complete(self) -> bool:
        return self.filled >= self.spec.num_tokens

    def absorb(self, sums: torch.Tensor, memory: torch.Tensor, last_state: torch.Tensor, end: int) -> None:
        self.sums = sums if self.sums is None else self.sums + sums
        self.memory.append(memory)
        self.last_state = last_state
        self.filled = end


def accumulate(head: JointSchemaHead, hidden: torch.Tensor,
               pieces: Sequence[tuple[RecordAccumulator, int, int, int]]) -> None:
    """Feed one step's hidden states ``[T, H]`` to several records at once.

    ``pieces[i] = (accumulator, row_offset, num_rows, start_position)``: rows
    ``hidden[row_offset:row_offset+num_rows]`` are positions ``start_position...`` of that record.
    One LayerNorm, one projection and one scatter-add serve all records of the step.
    """
    if not pieces:
        return
    states, memory = head.encode_tokens(hidden)
    seg, bases, base = [], [], 0
    for acc, off, n, start in pieces:
        seg.append(acc.segments[start:start + n] + base)
        bases.append(base)
        base += acc.spec.num_segments + 1
    rows = torch.cat([torch.arange(off, off + n, device=hidden.device) for _, off, n, _ in pieces]) \
        if len(pieces) > 1 or pieces[0][1] != 0 or pieces[0][2] != hidden.shape[0] else None
    picked = states if rows is None else states.index_select(0, rows)
    sums = segment_sum(picked, torch.cat(seg), base)
    for (acc, off, n, start), b in zip(pieces, bases):
        acc.absorb(sums[b:b + acc.spec.num_segments + 1], memory[off:off + n].clone(),
                   states[off + n - 1].clone(), start + n)


def decide_records(head: JointSchemaHead, table: LexicalTable,
                   records: Sequence[RecordAccumulator]) -> list[torch.Tensor]:
    """Run the head on finished records; returns per-record fp32 probabilities (encoded option order).

    All index data goes to the device in one pinned transfer and nothing here waits for the GPU,
    so the head's kernels queue behind the backbone's instead of stalling the step.
    """
    dtype = head.dtype
    device = records[0].sums.device
    cpu_layout = FieldLayout.from_records([(r.spec.type_ids, r.spec.options_per_field) for r in records])
    lex_ids, lex_seg, option_counts, span_lengths = [], [], [], []
    for r in records:
        counts = [b - a for a, b in r.spec.option_spans]
        lex_ids.extend(r.spec.lexical_ids)
        lex_seg.extend(len(option_counts) + j for j, n in enumerate(counts) for _ in range(n))
        option_counts.extend(counts)
        span_lengths.extend(b - a for a, b in r.spec.spans())
    memories = [torch.cat(r.memory) if len(r.memory) > 1 else r.memory[0] for r in records]
    lengths = [m.shape[0] for m in memories]
    names = ("type_ids", "field_record", "field_slot", "option_field", "option_record", "option_slot")
    moved = upload([getattr(cpu_layout, n) for n in names]
                   + [torch.tensor(v, dtype=torch.long) for v in (lex_ids, lex_seg, option_counts, span_lengths,
                                                                   lengths)], device)
    layout = replace(cpu_layout, **dict(zip(names, moved[:6])))
    ids, seg, counts, span_len, mem_len = moved[6:]

    questions, contexts, start = [], [], 0
    for r in records:
        n = r.spec.num_segments
        means = (r.sums[:-1] / span_len[start:start + n, None].float()).to(dtype)
        questions.append(means[: r.spec.num_fields])
        contexts.append(means[r.spec.num_fields:])
        start += n
    num_options = len(option_counts)
    lexical = (segment_sum(table.rows(ids, dtype), seg, num_options) / counts[:, None].float()).to(dtype)

    if len(set(lengths)) == 1:
        memory, padding = torch.stack(memories), None
    else:
        memory = torch.nn.utils.rnn.pad_sequence(memories, batch_first=True)
        padding = torch.arange(memory.shape[1], device=device)[None, :] >= mem_len[:, None]
    batch = DecisionBatch(memory=memory, memory_padding=padding,
                          last_state=torch.stack([r.last_state for r in records]),
                          question_state=torch.cat(questions), option_context=torch.cat(contexts),
                          option_lexical=lexical, layout=layout)
    probs = head.probabilities(head.decide(batch), layout)
    return list(probs.split([r.spec.num_options for r in records]))

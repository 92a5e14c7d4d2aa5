"""JointSchemaHead (docs/encoding-and-head.md): per-option logits for every field of every record.

The module keeps the release's exact state-dict names (``joint_head.safetensors`` loads with
strict checking) and splits the computation in two stages so that chunked prefill can feed it:

* :meth:`JointSchemaHead.encode_tokens` is per token (LayerNorm + memory projection) and can run
  on any chunk of hidden states;
* :meth:`JointSchemaHead.decide` runs once per record on what the chunks accumulated (memory,
  span means, last state) and is vectorised over records, fields and options: records are padded
  into one batch, options and fields are flat index tensors, per-field softmaxes are segment ops.

Numerics follow the reference: the head runs in the backbone's dtype (bf16) unless asked for
fp32; reductions (span means, option pooling) accumulate in fp32 and round once, as a matmul or
``mean`` does; only the final logits are upcast to fp32 for the softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

LOG_100 = math.log(100.0)


_REQUIRED_KEYS = ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward")


class HeadConfigError(ValueError):
    """``joint_head_config.json`` is malformed."""


@dataclass(frozen=True)
class HeadConfig:
    """``joint_head_config.json``. Unknown keys are an error."""

    hidden_size: int
    width: int
    routing_layers: int
    layers: int
    heads: int
    feedforward: int
    dropout: float = 0.0
    requires_clef_vllm: str | None = None

    @classmethod
    def from_dict(cls, data: dict, source: str = "joint_head_config.json") -> "HeadConfig":
        if not isinstance(data, dict):
            raise HeadConfigError(f"{source}: expected a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise HeadConfigError(f"{source}: unknown key(s) {unknown}; known keys are {sorted(known)}. "
                                  "A newer clef-vllm may be needed for this checkpoint.")
        missing = [n for n in _REQUIRED_KEYS if n not in data]
        if missing:
            raise HeadConfigError(f"{source}: missing key(s) {missing}")
        for name in _REQUIRED_KEYS:
            value = data[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if "layers" in name else 1):
                raise HeadConfigError(f"{source}: {name} must be a positive integer, got {value!r}")
        if data["width"] % data["heads"]:
            raise HeadConfigError(f"{source}: width {data['width']} is not divisible by heads {data['heads']}")
        marker = data.get("requires_clef_vllm")
        if marker is not None and not isinstance(marker, str):
            raise HeadConfigError(f"{source}: requires_clef_vllm must be a PEP 440 specifier string")
        return cls(**data)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["requires_clef_vllm"] is None:
            del out["requires_clef_vllm"]
        if not out["dropout"]:
            del out["dropout"]
        return out


# --------------------------------------------------------------------------- building blocks


#: Few queries over a long memory attend by two matmuls instead of SDPA's fused kernel from this many
#: keys on. The fused kernel (memory-efficient: vLLM turns PyTorch's cuDNN attention off) gives each
#: (record, head, 64-query tile) one thread block that walks every key: one record's queries over a
#: 16k-token state ran on 16 of the H200's 132 SMs, 0.95 ms per attention. The head's whole decision
#: on the H200: 16,384 rows 7.06 → 2.38 ms, 4,096 rows 2.13 → 1.22, 1,024 rows 1.10 → 0.95
#: (bench/results/h200_head_attention_routes.json; docs/latency.md, "Head attention over long states").
MATMUL_MIN_KEYS = 1024
#: ... as long as the fused kernel would run fewer tiles than this (about one per SM) ...
MATMUL_MAX_TILES = 128
#: ... and what it materialises (fp32 keys, fp32 scores and softmax, the bf16 weights) fits in this many bytes.
MATMUL_MAX_BYTES = 1 << 28


def attention_route(records: int, heads: int, queries: int, keys: int, head_dim: int) -> str:
    """``"matmul"`` or ``"fused"`` (SDPA) for an attention of these shapes; shapes only, so a captured
    graph always takes the route it was captured with."""
    tiles = records * heads * -(-queries // 64)
    scratch = records * heads * keys * (10 * queries + 4 * head_dim)
    if keys >= MATMUL_MIN_KEYS and tiles < MATMUL_MAX_TILES and scratch <= MATMUL_MAX_BYTES:
        return "matmul"
    return "fused"


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``softmax(q·kᵀ/√d, masked) · v`` as two matmuls (every record, head and key block in parallel).

    Scores and the softmax are fp32, as inside SDPA's kernels; the weights meet ``v`` in its dtype
    (bf16 weights × bf16 values, fp32 accumulation), as they do there. ``keep`` is True on keys to
    attend (broadcast over heads and queries)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    if keep is not None:
        scores.masked_fill_(~keep, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


class Attention(nn.Module):
    """Multi-head attention with ``nn.MultiheadAttention``'s parameter layout (packed q;k;v).

    Keys and values are the same tensor everywhere in the head. ``key_padding_mask`` is True
    on padded key positions (records of different lengths in one batch); real keys are never
    masked, as in the release. :func:`attention_route` picks the kernel: SDPA, or two matmuls for a
    few queries over a long memory.
    """

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, query: torch.Tensor, key_value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, lq, d = query.shape
        lk = key_value.shape[1]
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        h = self.heads
        q = F.linear(query, w_q, b_q).view(b, lq, h, d // h).transpose(1, 2)
        k = F.linear(key_value, w_k, b_k).view(b, lk, h, d // h).transpose(1, 2)
        v = F.linear(key_value, w_v, b_v).view(b, lk, h, d // h).transpose(1, 2)
        mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
        if attention_route(b, h, lq, lk, d // h) == "matmul":
            out = matmul_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, lq, d))


class EvidenceLayer(nn.Module):
    """Option queries attend to the (normalised) state memory, then a GELU feed-forward."""

    def __init__(self, width: int, heads: int, feedforward: int, dropout: float = 0.0):
        super().__init__()
        self.query_norm = nn.LayerNorm(width)
        self.memory_norm = nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.feedforward_norm = nn.LayerNorm(width)
        self.feedforward = nn.Sequential(nn.Linear(width, feedforward), nn.GELU(), nn.Dropout(dropout),
                                         nn.Linear(feedforward, width), nn.Dropout(dropout))

    def forward(self, queries, memory, memory_padding):
        memory = self.memory_norm(memory)
        queries = queries + self.attention(self.query_norm(queries), memory, memory_padding)
        return queries + self.feedforward(self.feedforward_norm(queries))


class DecoderLayer(nn.Module):
    """``nn.TransformerDecoderLayer(norm_first=True, activation="gelu")`` without masks, same names."""

    def __init__(self, width: int, heads: int, feedforward: int, dropout: float = 0.0):
        super().__init__()
        self.self_attn = Attention(width, heads)
        self.multihead_attn = Attention(width, heads)
        self.linear1 = nn.Linear(width, feedforward)
        self.linear2 = nn.Linear(feedforward, width)
        self.norm1 = nn.LayerNorm(width)
        self.norm2 = nn.LayerNorm(width)
        self.norm3 = nn.LayerNorm(width)

    def forward(self, x, field_padding, memory, memory_padding):
        h = self.norm1(x)
        x = x + self.self_attn(h, h, field_padding)
        x = x + self.multihead_attn(self.norm2(x), memory, memory_padding)
        return x + self.linear2(F.gelu(self.linear1(self.norm3(x))))


# --------------------------------------------------------------------------- batch layout


def ranks_within(sizes: np.ndarray) -> np.ndarray:
    """``0 … n-1`` for each group of ``sizes`` (groups laid end to end): each item's place in its group."""
    return np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)


def span_positions(spans: np.ndarray) -> np.ndarray:
    """Every position covered by ``spans`` ([S, 2] half-open), span by span, without a Python loop."""
    lengths = spans[:, 1] - spans[:, 0]
    return ranks_within(lengths) + np.repeat(spans[:, 0], lengths)


@dataclass
class FieldLayout:
    """Where every field and option of a batch of records sits, as flat index tensors."""

    type_ids: torch.Tensor       # [Q] 0 noul, 1 choice, 2 score
    field_record: torch.Tensor   # [Q] record of each field
    field_slot: torch.Tensor     # [Q] position of the field inside its record
    option_field: torch.Tensor   # [N] field of each option (global field index)
    option_record: torch.Tensor  # [N]
    option_slot: torch.Tensor    # [N] position of the option inside its record
    num_records: int
    max_fields: int
    max_options: int

    @classmethod
    def from_records(cls, records: Sequence[tuple[Sequence[int], Sequence[int]]]) -> "FieldLayout":
        """``records[b] = (type_ids, options_per_field)``. Built with numpy, a few array operations per
        step whatever the numbers of records, fields and options (it runs in vLLM's engine core)."""
        fields_per = np.array([len(types) for types, _ in records], dtype=np.int64)
        type_ids = np.fromiter((t for types, _ in records for t in types), dtype=np.int64, count=int(fields_per.sum()))
        counts = np.fromiter((n for _, c in records for n in c), dtype=np.int64, count=type_ids.size)
        field_record = np.repeat(np.arange(len(records), dtype=np.int64), fields_per)
        option_field = np.repeat(np.arange(type_ids.size, dtype=np.int64), counts)
        options_per = np.bincount(field_record, weights=counts, minlength=len(records)).astype(np.int64)
        t = torch.from_numpy
        return cls(t(type_ids), t(field_record), t(ranks_within(fields_per)), t(option_field),
                   t(field_record[option_field]), t(ranks_within(options_per)), len(records),
                   int(fields_per.max(initial=0)), int(options_per.max(initial=0)))

    def to(self, device) -> "FieldLayout":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return FieldLayout(**moved)


@dataclass
class DecisionBatch:
    """What :meth:`JointSchemaHead.decide` needs for B records (all in the head's dtype)."""

    memory: torch.Tensor                   # [B, Lmax, D] memory projection of every position
    memory_padding: torch.Tensor | None    # [B, Lmax] True on padding, or None if no padding
    last_state: torch.Tensor               # [B, H] normalised hidden state of the last token
    question_state: torch.Tensor           # [Q, H] mean over each question span
    option_context: torch.Tensor           # [N, H] mean over each option span
    option_lexical: torch.Tensor           # [N, H] mean lm_head row of each option's tokens
    layout: FieldLayout
    field_padding: torch.Tensor | None = None   # [B, max_fields] True on slots no real field holds
                                                # (default: the slots the layout leaves empty)


def _scatter_to_slots(values: torch.Tensor, record: torch.Tensor, slot: torch.Tensor, b: int, n: int):
    out = values.new_zeros(b, n, values.shape[-1])
    out[record, slot] = values
    padding = torch.ones(b, n, dtype=torch.bool, device=values.device)
    # A device-side False: assigning the Python scalar copies it from pageable host memory, which
    # synchronises the host with the GPU stream (and cannot be captured in a CUDA graph).
    padding.index_put_((record, slot), torch.zeros((), dtype=torch.bool, device=values.device))
    return out, padding


def segment_softmax(scores: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Softmax of ``scores`` within each segment (fp32 in, fp32 out); no cross-segment mixing."""
    top = scores.new_full((num_segments,), float("-inf")).scatter_reduce(0, segment, scores, "amax")
    e = torch.exp(scores - top[segment])
    return e / scores.new_zeros(num_segments).index_add(0, segment, e)[segment]


def segment_sum(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """fp32 sums of rows of ``values`` per segment."""
    out = torch.zeros(num_segments, values.shape[-1], dtype=torch.float32, device=values.device)
    return out.index_add_(0, segment, values.float())


# --------------------------------------------------------------------------- the head


class JointSchemaHead(nn.Module):
    """The release's joint schema head. State-dict names match ``joint_head.safetensors``."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        h, d, f, p = config.hidden_size, config.width, config.feedforward, config.dropout
        self.hidden_norm = nn.LayerNorm(h)
        self.memory_projection = nn.Linear(h, d, bias=False)
        self.question_projection = nn.Linear(h, d, bias=False)
        self.option_question_projection = nn.Linear(h, d, bias=False)
        self.global_projection = nn.Linear(h, d, bias=False)
        self.option_context_projection = nn.Linear(h, d, bias=False)
        self.option_lexical_projection = nn.Linear(h, d, bias=False)
        self.type_embedding = nn.Embedding(3, d)
        self.evidence_layers = nn.ModuleList(EvidenceLayer(d, config.heads, f, p) for _ in range(config.routing_layers))
        self.option_summary_norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(DecoderLayer(d, config.heads, f, p) for _ in range(config.layers))
        self.field_norm = nn.LayerNorm(d)
        self.option_norm = nn.LayerNorm(d)
        self.residual_scorer = nn.Sequential(nn.Linear(4 * d, d), nn.GELU(), nn.Dropout(p), nn.Linear(d, 1))
        self.prior_logit_scale = nn.Parameter(torch.zeros(()))
        self.joint_logit_scale = nn.Parameter(torch.zeros(()))
        self.residual_gate = nn.Parameter(torch.zeros(()))

    @property
    def dtype(self) -> torch.dtype:
        return self.memory_projection.weight.dtype

    def encode_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token stage for any chunk ``[T, H]``: ``S = LN(X)`` and memory ``M = S·W_memᵀ``."""
        states = self.hidden_norm(hidden.to(self.dtype))
        return states, self.memory_projection(states)

    def decide(self, batch: DecisionBatch) -> torch.Tensor:
        """Per-option logits ``[N]`` (fp32), options in encoded order, fields in request order."""
        lay = batch.layout
        b, d = lay.num_records, self.config.width
        q, g = batch.question_state, batch.last_state
        memory, memory_padding = batch.memory, batch.memory_padding

        # Option queries, then evidence routing over the state memory (per record, padded).
        u = (self.option_context_projection(batch.option_context)
             + self.option_lexical_projection(batch.option_lexical)
             + self.option_question_projection(q)[lay.option_field])
        queries, _ = _scatter_to_slots(u, lay.option_record, lay.option_slot, b, lay.max_options)
        for layer in self.evidence_layers:
            queries = layer(queries, memory, memory_padding)
        routed = queries[lay.option_record, lay.option_slot]                     # [N, D]

        # Field vectors: question base + attention-pooled options + global + type.
        base = self.question_projection(q)                                       # [Q, D]
        scores = (routed.float() * base[lay.option_field].float()).sum(-1).to(self.dtype) / math.sqrt(d)
        weights = segment_softmax(scores.float(), lay.option_field, len(lay.type_ids)).to(self.dtype)
        pooled = segment_sum(weights.float()[:, None] * routed.float(), lay.option_field, len(lay.type_ids)).to(self.dtype)
        field_vec = (base + self.option_summary_norm(pooled) + self.global_projection(g)[lay.field_record]
                     + self.type_embedding(lay.type_ids))

        # Joint field decoder: fields attend to each other (per record) and to the raw memory.
        fields_pad, field_padding = _scatter_to_slots(field_vec, lay.field_record, lay.field_slot, b, lay.max_fields)
        if batch.field_padding is not None:       # a padded layout (head graphs) marks its spare fields
            field_padding = batch.field_padding
        for layer in self.layers:
            fields_pad = layer(fields_pad, field_padding, memory, memory_padding)
        final = self.field_norm(fields_pad[lay.field_record, lay.field_slot])    # [Q, D]

        # Scores: lexical prior + gated (cosine + residual MLP).
        sigma_p = self.prior_logit_scale.clamp(max=LOG_100).exp()
        sigma_j = self.joint_logit_scale.clamp(max=LOG_100).exp()
        gamma = torch.sigmoid(self.residual_gate)
        anchor = (q[lay.option_field] + g[lay.option_record]).float()
        prior = sigma_p * (F.normalize(batch.option_lexical.float(), dim=-1, eps=1e-12)
                           * F.normalize(anchor, dim=-1, eps=1e-12)).sum(-1).to(self.dtype)
        opt = self.option_norm(routed)
        fld = final[lay.option_field]
        residual = self.residual_scorer(torch.cat([fld, opt, fld * opt, (fld - opt).abs()], dim=-1)).squeeze(-1)
        cosine = F.cosine_similarity(fld, opt, dim=-1, eps=1e-8)
        return (prior + gamma * (sigma_j * cosine + residual)).float()

    @staticmethod
    def probabilities(logits: torch.Tensor, layout: FieldLayout) -> torch.Tensor:
        """Per-field softmax of fp32 logits (no cross-field normalisation)."""
        return segment_softmax(logits.float(), layout.option_field, len(layout.type_ids))


def count_parameters(config: HeadConfig) -> int:
    """Closed-form parameter count (121,762,820 for the release), for checking loaders."""
    h, d, f = config.hidden_size, config.width, config.feedforward
    routing = 4 * d * d + 2 * d * f + 11 * d + f
    decoder = 8 * d * d + 2 * d * f + 15 * d + f
    return (2 * h + 6 * h * d + 3 * d + config.routing_layers * routing + 2 * d
            + config.layers * decoder + 4 * d + (4 * d * d + 2 * d + 1) + 3)

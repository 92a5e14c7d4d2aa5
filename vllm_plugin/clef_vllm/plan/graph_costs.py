"""What the plugin's CUDA graphs and the GDN prefill hold on the GPU, estimated from settings (no torch, no vLLM).

The worker captures its step, GDN and head graphs after vLLM has sized the KV cache, so their memory
pools are not in vLLM's profile: :class:`clef_vllm.worker.budget.ClefWorker` takes this estimate out of the
KV cache, and :mod:`clef_vllm.plan.memory_plan` counts it in the plan. The figures were measured on the 9B-shaped
model (hidden 4,096, intermediate 12,288):

* head graphs: one pool shared by every bucket's graph (:mod:`clef_vllm.worker.fast.head_graphs`), about the
  same size whatever their records and memory rows (one figure);
* GDN graphs: per GDN layer, the core's buffers at the largest prefill bucket (linear in it, scaled by the
  hidden size);
* step graphs: the whole backbone's activations at the largest prefill bucket (one pool; linear in it,
  scaled by hidden + intermediate size).
"""

from __future__ import annotations

from collections.abc import Sequence

#: The head graphs' pool: 1.27-1.34 GiB measured at 9B whatever the records (4 or 16) and the longest decision
#: (4,096 or 16,384 rows) its ~100 graphs hold (H100 and H200): per-graph workspaces, not the head's widths or
#: memory rows, size it, so the figure is the same for every checkpoint.
HEAD_GRAPH_BYTES = int(1.3 * (1 << 30))
#: GDN-graph bytes per token of the largest bucket, all 24 layers together, at hidden 4,096.
GDN_GRAPH_BYTES_PER_TOKEN = 100_000
#: Step-graph pool bytes per token of the largest size, at hidden 4,096 / intermediate 12,288.
STEP_GRAPH_BYTES_PER_TOKEN = 170_000
#: The 9B-shaped model the figures were measured on.
REFERENCE_HIDDEN, REFERENCE_INTERMEDIATE = 4096, 12288

def graph_reservation(*, hidden: int, intermediate: int, head_records: int, prefill_buckets: Sequence[int] = (),
                      step_graphs: bool = False) -> dict[str, int]:
    """Bytes each kind of plugin graph holds once captured: ``{"head graphs": ..., "GDN graphs": ...,
    "step graphs": ...}`` (kinds that are off are left out)."""
    out: dict[str, int] = {}
    width = hidden / REFERENCE_HIDDEN
    if head_records:
        out["head graphs"] = HEAD_GRAPH_BYTES
    if prefill_buckets:
        tokens = max(prefill_buckets)
        out["GDN graphs"] = int(tokens * GDN_GRAPH_BYTES_PER_TOKEN * width)
        if step_graphs:
            per_token = STEP_GRAPH_BYTES_PER_TOKEN * (hidden + intermediate) / (REFERENCE_HIDDEN +
                                                                                 REFERENCE_INTERMEDIATE)
            out["step graphs"] = int(tokens * per_token)
    return out


# --------------------------------------------------------------------------- the GDN prefill's step

#: The chunk length of vLLM's GDN prefill kernels (FLA's ``chunk_size``).
GDN_CHUNK = 64
#: A sequence one token past a chunk: the most chunks per token a step can hold.
WORST_LENGTH = GDN_CHUNK + 1


def worst_prefill_lengths(tokens: int, max_sequences: int) -> list[int]:
    """The sequence lengths of the costliest GDN prefill step of ``tokens`` tokens: as many sequences of
    :data:`WORST_LENGTH` tokens as ``max_sequences`` allows, the last taking the rest."""
    n = max(1, min(int(max_sequences), tokens // WORST_LENGTH))
    return [WORST_LENGTH] * (n - 1) + [tokens - WORST_LENGTH * (n - 1)]


def gdn_prefill_bytes(tokens: int, max_sequences: int, *, key_heads: int, value_heads: int, key_dim: int,
                      value_dim: int, ssm_bytes: int = 4, dtype_bytes: int = 2) -> int:
    """What one GDN layer's prefill core allocates in the step of :func:`worst_prefill_lengths` (vLLM 0.28's
    Triton path, FLA's chunk kernels): per token the convolution's output and ``q``/``k``/``v``, ``g`` and
    ``beta``, the chunk kernels' solved ``A``, ``w``, ``u``, the new values and the output (all alive at its
    last kernel); per chunk one recurrent state; per sequence its initial state (gathered) and its final
    state (float32)."""
    lengths = worst_prefill_lengths(tokens, max_sequences)
    chunks = sum(-(-n // GDN_CHUNK) for n in lengths)
    conv = 2 * key_heads * key_dim + value_heads * value_dim
    # at the output kernel: g, beta, the cumulative g, the solved A (bf16), w, u, the new values and the output
    per_token = 2 * conv * dtype_bytes + value_heads * (
        4 + dtype_bytes + 4 + GDN_CHUNK * dtype_bytes + dtype_bytes * (key_dim + 3 * value_dim))
    state = value_heads * key_dim * value_dim
    return tokens * per_token + chunks * state * dtype_bytes + len(lengths) * state * (ssm_bytes + 4)


def gdn_live_bytes(tokens: int, *, hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                   dtype_bytes: int = 2) -> int:
    """What the step holds when a GDN layer's core starts: the hidden states and the residual, the layer's
    input projections and the core's output buffer."""
    conv = 2 * key_heads * key_dim + value_heads * value_dim
    return tokens * dtype_bytes * (2 * hidden + conv + value_heads * value_dim + 2 * value_heads
                                   + value_heads * value_dim)

"""What the plugin's CUDA graphs hold on the GPU, estimated from their settings (no torch, no vLLM).

The worker captures its step, GDN and head graphs after vLLM has sized the KV cache, so their memory
pools are not in vLLM's profile: :class:`clef_vllm.worker.budget.ClefWorker` takes this estimate out of the
KV cache, and :mod:`clef_vllm.memory_plan` counts it in the plan. The figures were measured on the 9B-shaped
model (hidden 4,096, intermediate 12,288):

* head graphs: one pool shared by every bucket's graph (:mod:`clef_vllm.worker.head_graphs`), about the
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

"""What the plugin's CUDA graphs hold on the GPU, estimated from their settings (no torch, no vLLM).

The worker captures its step, GDN and head graphs after vLLM has sized the KV cache, so their memory
pools are not in vLLM's profile: :class:`clef_vllm.worker.budget.ClefWorker` takes this estimate out of the
KV cache, and :mod:`clef_vllm.memory_plan` counts it in the plan. Each figure is linear in what sizes the
pool, with a per-unit cost measured on the 9B-shaped model (hidden 4,096, intermediate 12,288) and scaled
by the model's widths:

* head graphs: one pool shared by every bucket's graph, sized by the largest bucket's memory rows (the
  records of a step times the rows each may hold; :mod:`clef_vllm.worker.head_graphs`);
* GDN graphs: per GDN layer, the core's buffers at the largest prefill bucket;
* step graphs: the whole backbone's activations at the largest prefill bucket (one pool).
"""

from __future__ import annotations

from collections.abc import Sequence

#: Head-graph pool bytes per memory row of the largest bucket, at hidden 4,096: 1.29 GiB for decisions up to
#: 16,384 rows (4 records) and 1.34 GiB with 16 records, whose 16 x 2,048-row short-decision graphs hold
#: narrower schemas: a several-record bucket's rows count half (:func:`head_graph_rows`).
HEAD_GRAPH_BYTES_PER_ROW = 84_500
#: GDN-graph bytes per token of the largest bucket, all 24 layers together, at hidden 4,096.
GDN_GRAPH_BYTES_PER_TOKEN = 100_000
#: Step-graph pool bytes per token of the largest size, at hidden 4,096 / intermediate 12,288.
STEP_GRAPH_BYTES_PER_TOKEN = 170_000
#: The 9B-shaped model the figures were measured on.
REFERENCE_HIDDEN, REFERENCE_INTERMEDIATE = 4096, 12288
#: Head graphs: the memory buckets (rows per record) and the most rows a several-record graph holds
#: (the same numbers as :mod:`clef_vllm.worker.head_graphs`, kept here free of torch).
HEAD_MEMORY_BUCKETS = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576,
                       32768)
SEVERAL_MEMORY_LIMIT, SEVERAL_ROWS = 2048, 32768


def head_graph_rows(records: int, max_memory: int) -> int:
    """The rows that size the head graphs' pool when steps finishing up to ``records`` requests are graphed with
    memory buckets up to ``max_memory`` rows: one record's largest bucket, or half the rows of several records'
    short decisions (their schema buckets are at most 16 fields / 64 options, a quarter of one record's)."""
    if records <= 0:
        return 0
    single = max((b for b in HEAD_MEMORY_BUCKETS if b <= max_memory), default=HEAD_MEMORY_BUCKETS[0])
    several = max((r * min(SEVERAL_MEMORY_LIMIT, SEVERAL_ROWS // r, single) // 2 for r in (2, 4, 8, 16, 32, 64)
                   if r <= records), default=0)
    return max(single, several)


def graph_reservation(*, hidden: int, intermediate: int, max_model_len: int, head_records: int,
                      head_memory: int = 0, prefill_buckets: Sequence[int] = (),
                      step_graphs: bool = False) -> dict[str, int]:
    """Bytes each kind of plugin graph holds once captured: ``{"head graphs": ..., "GDN graphs": ...,
    "step graphs": ...}`` (kinds that are off are left out). ``head_memory``: the most memory rows a
    single-record head graph holds (0: ``max_model_len``)."""
    out: dict[str, int] = {}
    width = hidden / REFERENCE_HIDDEN
    if head_records:
        rows = head_graph_rows(head_records, head_memory or max_model_len)
        out["head graphs"] = int(rows * HEAD_GRAPH_BYTES_PER_ROW * width)
    if prefill_buckets:
        tokens = max(prefill_buckets)
        out["GDN graphs"] = int(tokens * GDN_GRAPH_BYTES_PER_TOKEN * width)
        if step_graphs:
            per_token = STEP_GRAPH_BYTES_PER_TOKEN * (hidden + intermediate) / (REFERENCE_HIDDEN +
                                                                                 REFERENCE_INTERMEDIATE)
            out["step graphs"] = int(tokens * per_token)
    return out

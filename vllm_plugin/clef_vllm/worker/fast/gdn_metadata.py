"""One GDN attention-metadata build per step, shared by every GDN KV-cache group.

vLLM 0.28 builds attention metadata once per KV-cache group. The 9B's 24 GDN layers sit in three
groups (8 layers each, like its 8 attention layers), so every step builds the GDN metadata three
times: chunk indices and offsets, the causal-conv metadata, the initial-state flags, each with its
host work and host-to-device copies. Only the state indices differ between the groups: they come
from each group's block table. vLLM's model runner already has the mechanism for this: a builder
that ``supports_update_block_table`` builds once per step and KV-cache spec, and the later groups
get ``update_block_table(metadata, their block table, their slot mapping)``. vLLM's Mamba builders
implement it; its GDN builder does not. :func:`install` adds it, for steps without speculative
decoding or full CUDA graphs (a pooling model has neither): the update recomputes exactly the
fields that ``build`` derives from the block table (the non-speculative and prefill state indices,
through vLLM's own ``mamba_get_block_table_tensor``) and shares the rest.

A step server's engine-core profile (a torch-profiler trace) shows why: without it the backbone's graph is
launched 8-12 ms (profiled) into a short step, three ~1 ms stretches of it one repeated build.
``tests/test_gdn_metadata.py`` checks the update against vLLM's own build of the later group, field
by field, on CPU.

**One build per prefill length.** For a step of one prefill sequence, everything the GDN build derives
besides the state indices depends only on the sequence's new-token count and on whether it continues
from a state: the FLA chunk indices and offsets and the causal-conv metadata come from the query start
locations ``[0, n]``, the initial-state flags from ``context > 0``. Those are a dozen host ops, two pinned
allocations and their host-to-device copies per step (a step's trace puts vLLM's attention
metadata at ~1.9 ms of a short step), and the step graphs read only the state line and the flag of it. So
the first group's builder keeps the metadata of such steps (the :data:`MEMO_SIZE` most recently used keys) and
answers a later step of the same key with it, its state indices recomputed from this step's block table
as :func:`update_block_table` does, its query start locations this step's (the same persistent buffer).
Every tensor the kept metadata owns was made by its own build and is never written afterwards (vLLM's
causal-conv op only reads the conv metadata when it is given). The tests compare such a hit with vLLM's
own build, field by field, after builds of other lengths. ``--gdn-metadata-memo off`` (the engine's
:attr:`clef_vllm.contract.WorkerSettings.gdn_metadata_memo` false) turns the memo off; the shared build stays.

**State lines read, not gathered** (:func:`state_table`). With the state cache on, vLLM keeps one
state line per block of a sequence (``mamba_cache_mode="align"``) and finds a step's lines with
``mamba_get_block_table_tensor``: seven small GPU operations (the column ``(seq_len - 1) // block``, an
``arange``, a ``gather``) for every GDN group, three times a step on the 9B. Profiled with the
Python tracer (``bench/results/clef_bench/h200_9b_fp8_stack_cache_{on,off}_py_calls_steps.txt``, the second
step) they were what the state cache added to one short step's attention metadata (0.86 of its 2.0 ms
against 1.2 ms with the cache off). The sequence lengths are known on the host (vLLM's ``_seq_lens_cpu``, exact
outside asynchronous speculative decoding, which a pooling model never runs), so when every row of
the step reads the same column, the lines are that column of the group's block table: a view for
one sequence, one copy for several. Other steps keep vLLM's function. The tests compare both ways
with vLLM's own build and with ``mamba_get_block_table_tensor``.
"""

from __future__ import annotations

import dataclasses

#: where a build keeps its step's sequence lengths (the update needs them in vLLM's ``align`` mode)
SEQ_LENS = "_clef_seq_lens"
#: ... and the same lengths on the host (``None`` where vLLM has none), for :func:`state_table`
SEQ_LENS_CPU = "_clef_seq_lens_cpu"
#: ... and the step's query start locations on the host (where each sequence's rows begin), for the step
#: graphs' replay of a small batch one sequence at a time (:mod:`clef_vllm.worker.fast.step_graphs`)
QUERY_START_CPU = "_clef_query_start_loc_cpu"
#: where a builder keeps its single-prefill metadata, by :func:`memo_key`
MEMO = "_clef_memo"
#: how many single-prefill keys a builder keeps, the least recently used going first (one key holds ~20 KB
#: of GPU memory: the causal-conv op's two 2,048-entry program tables, the chunk indices, the flags)
MEMO_SIZE = 512
#: the builder class's switch for the memo (set by :func:`install`)
MEMO_ON = "_clef_memo_on"
#: this process's single-prefill builds (``built``) and answers from a memo (``reused``), for GPU tests
STATS = {"built": 0, "reused": 0}


def shareable(builder) -> bool:
    """Whether ``update_block_table`` reproduces ``builder``'s build (no speculative decoding, whose
    state indices and masks are built differently; no full CUDA graphs, whose decode steps copy into
    persistent buffers)."""
    return not builder.use_spec_decode and not builder.use_full_cuda_graph


def update_block_table(self, metadata, blk_table, slot_mapping):
    """``metadata`` (built for another KV-cache group in this step) with this group's state indices."""
    seq_lens = metadata.__dict__.get(SEQ_LENS)
    if seq_lens is None or metadata.spec_sequence_masks is not None:
        raise RuntimeError("clef GDN metadata: update_block_table got metadata it did not build "
                           "(speculative decoding, or built before the plugin was installed)")
    return with_state_indices(self, metadata, blk_table, seq_lens, metadata.__dict__.get(SEQ_LENS_CPU))


def state_table(builder, blk_table, seq_lens, seq_lens_cpu=None):
    """What vLLM's ``mamba_get_block_table_tensor`` gives for this group's ``blk_table``: in ``align``
    mode, without GPU work when ``seq_lens_cpu`` (the same lengths on the host) puts every row's state
    line in one column of the table (module docstring)."""
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

    spec, mode = builder.kv_cache_spec, builder.vllm_config.cache_config.mamba_cache_mode
    if mode == "align" and seq_lens_cpu is not None and getattr(spec, "num_speculative_blocks", 0) == 0 \
            and blk_table.dim() == 2 and len(seq_lens_cpu) == blk_table.shape[0] > 0:
        columns = {max((int(n) - 1) // spec.block_size, 0) for n in seq_lens_cpu.tolist()}
        if len(columns) == 1 and (column := columns.pop()) < blk_table.shape[1]:
            table = blk_table[:, column:column + 1]
            return table if table.shape[0] == 1 else table.contiguous()
    return mamba_get_block_table_tensor(blk_table, seq_lens, spec, mode)


def with_state_indices(builder, metadata, blk_table, seq_lens, seq_lens_cpu=None, **fields):
    """A copy of ``metadata`` (with ``fields`` replaced) whose state indices are those of ``blk_table``
    for ``seq_lens`` (on the host: ``seq_lens_cpu``, or ``None``), as ``builder``'s own build derives them."""
    non_spec = state_table(builder, blk_table, seq_lens, seq_lens_cpu)[:, 0]
    prefill = None
    if metadata.num_prefills > 0:
        prefill = non_spec[metadata.num_decodes:] if metadata.num_decodes > 0 else non_spec
    updated = dataclasses.replace(metadata, non_spec_state_indices_tensor=non_spec, prefill_state_indices=prefill,
                                  **fields)
    updated.__dict__[SEQ_LENS] = seq_lens
    updated.__dict__[SEQ_LENS_CPU] = seq_lens_cpu
    updated.__dict__[QUERY_START_CPU] = metadata.__dict__.get(QUERY_START_CPU)
    return updated


def memo_key(builder, common, extra: tuple, kwargs: dict) -> tuple | None:
    """The key of a step of one prefill sequence (its new tokens, whether it continues from a state), or
    ``None`` for any other step (several sequences, speculative decoding, full CUDA graphs)."""
    if common.num_reqs != 1 or not shareable(builder) or any(a is not None for a in extra) or \
            any(v is not None for k, v in kwargs.items() if k != "fast_build"):
        return None
    n = int(common.query_start_loc_cpu[1])
    if n < 2 or n != common.num_actual_tokens:          # one token is a decode; padded tokens: not ours
        return None
    return n, common.max_seq_len > n


def memo_build(builder, build, common_prefix_len, common, *extra, **kwargs):
    """``build``'s metadata for this step, from the builder's memo when a step of its key was built before."""
    key = memo_key(builder, common, extra, kwargs) if getattr(builder, MEMO_ON, True) else None
    memo = builder.__dict__.setdefault(MEMO, {}) if key is not None else None
    if memo is not None and key in memo:
        STATS["reused"] += 1
        memo[key] = kept = memo.pop(key)                  # the most recently used now
        answer = with_state_indices(builder, kept, common.block_table_tensor, common.seq_lens,
                                    getattr(common, "_seq_lens_cpu", None),
                                    non_spec_query_start_loc=common.query_start_loc,
                                    prefill_query_start_loc=common.query_start_loc)
        answer.__dict__[QUERY_START_CPU] = common.query_start_loc_cpu
        return answer
    metadata = build(builder, common_prefix_len, common, *extra, **kwargs)
    metadata.__dict__[SEQ_LENS] = common.seq_lens
    metadata.__dict__[SEQ_LENS_CPU] = getattr(common, "_seq_lens_cpu", None)
    metadata.__dict__[QUERY_START_CPU] = common.query_start_loc_cpu
    if memo is not None and metadata.num_prefills == 1 and metadata.num_decodes == 0 and \
            metadata.spec_sequence_masks is None:
        STATS["built"] += 1
        if len(memo) >= MEMO_SIZE:
            memo.pop(next(iter(memo)))
        memo[key] = metadata
    return metadata


def install(memo: bool = True) -> bool:
    """Teach vLLM's GDN metadata builder ``update_block_table`` (idempotent; in the engine process that
    serves Clef, from the model's constructor, so raw vLLM baselines stay vLLM's own), and keep the
    metadata of single-prefill steps when ``memo`` (each call sets it). ``False`` when this vLLM has no
    such builder."""
    try:
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as Builder
    except ImportError:
        return False
    setattr(Builder, MEMO_ON, bool(memo))
    if Builder.__dict__.get("_clef_shared"):
        return True
    build, init = Builder.build, Builder.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.supports_update_block_table = shareable(self)

    def shared_build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        return memo_build(self, build, common_prefix_len, common_attn_metadata, *args, **kwargs)

    Builder.__init__ = __init__
    Builder._clef_build = build                         # vLLM's own (the tests compare with it)
    Builder.build = shared_build
    Builder.update_block_table = update_block_table
    Builder._clef_shared = True
    return True

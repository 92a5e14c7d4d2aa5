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

Found in the step server's engine-core trace (``bench/step_timeline.py``): the backbone's graph was
launched 8-12 ms (profiled) into a short step, three ~1 ms stretches of it one repeated build.
``tests/test_gdn_metadata.py`` checks the update against vLLM's own build of the later group, field
by field, on CPU.
"""

from __future__ import annotations

import dataclasses

#: where a build keeps its step's sequence lengths (the update needs them in vLLM's ``align`` mode)
SEQ_LENS = "_clef_seq_lens"


def shareable(builder) -> bool:
    """Whether ``update_block_table`` reproduces ``builder``'s build (no speculative decoding, whose
    state indices and masks are built differently; no full CUDA graphs, whose decode steps copy into
    persistent buffers)."""
    return not builder.use_spec_decode and not builder.use_full_cuda_graph


def update_block_table(self, metadata, blk_table, slot_mapping):
    """``metadata`` (built for another KV-cache group in this step) with this group's state indices."""
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

    seq_lens = metadata.__dict__.get(SEQ_LENS)
    if seq_lens is None or metadata.spec_sequence_masks is not None:
        raise RuntimeError("clef GDN metadata: update_block_table got metadata it did not build "
                           "(speculative decoding, or built before the plugin was installed)")
    table = mamba_get_block_table_tensor(blk_table, seq_lens, self.kv_cache_spec,
                                         self.vllm_config.cache_config.mamba_cache_mode)
    non_spec = table[:, 0]
    prefill = None
    if metadata.num_prefills > 0:
        prefill = non_spec[metadata.num_decodes:] if metadata.num_decodes > 0 else non_spec
    updated = dataclasses.replace(metadata, non_spec_state_indices_tensor=non_spec, prefill_state_indices=prefill)
    updated.__dict__[SEQ_LENS] = seq_lens
    return updated


def install() -> bool:
    """Teach vLLM's GDN metadata builder ``update_block_table`` (idempotent; in the engine process that
    serves Clef, from the model's constructor, so raw vLLM baselines stay vLLM's own). ``False`` when
    this vLLM has no such builder."""
    try:
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as Builder
    except ImportError:
        return False
    if Builder.__dict__.get("_clef_shared"):
        return True
    build, init = Builder.build, Builder.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.supports_update_block_table = shareable(self)

    def shared_build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        metadata = build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        metadata.__dict__[SEQ_LENS] = common_attn_metadata.seq_lens
        return metadata

    Builder.__init__ = __init__
    Builder.build = shared_build
    Builder.update_block_table = update_block_table
    Builder._clef_shared = True
    return True

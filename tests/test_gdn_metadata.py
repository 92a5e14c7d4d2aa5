"""clef_vllm.worker.fast.gdn_metadata: vLLM's GDN metadata builder, taught ``update_block_table``, gives a later
KV-cache group exactly what its own build would, on CPU with vLLM 0.28's real builder."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from support import vllm_cpu

from clef_vllm.contract import WorkerSettings

pytest.importorskip("vllm")

BLOCK = 32


@pytest.fixture(scope="module")
def builders(tiny_release):
    """Two GDN builders (two KV-cache groups of one spec) per mamba cache mode, with the plugin installed."""
    vllm_cpu.setup()
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    from clef_vllm import register
    from clef_vllm.worker.fast import gdn_metadata

    register()
    assert gdn_metadata.install() and gdn_metadata.install()          # idempotent
    out = {}
    for mode in ("align", "none"):
        config = vllm_cpu.vllm_config_for(tiny_release)
        config.cache_config.mamba_cache_mode = mode
        spec = MambaSpec(block_size=BLOCK, shapes=((4, 3), (2, 8, 8)), dtypes=(torch.bfloat16, torch.float32),
                         mamba_cache_mode=mode)
        with set_current_vllm_config(config):
            out[mode] = [GDNAttentionMetadataBuilder(spec, [f"layers.{i}.linear_attn"], config, torch.device("cpu"))
                         for i in range(2)]
    return out


def common(query_lens: list[int], computed: list[int], table: list[list[int]]):
    """vLLM's per-group common metadata for prefills of ``query_lens`` new tokens after ``computed`` ones."""
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata

    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor([q + c for q, c in zip(query_lens, computed)], dtype=torch.int32)
    tokens = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=len(query_lens),
        num_actual_tokens=tokens, max_query_len=max(query_lens), max_seq_len=int(seq.max()),
        block_table_tensor=torch.tensor(table, dtype=torch.int32), slot_mapping=torch.arange(tokens), causal=True,
        _seq_lens_cpu=seq, _num_computed_tokens_cpu=torch.tensor(computed, dtype=torch.int32))


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


CASES = {   # (query lengths, tokens computed before, block tables of group 1 and group 2 (align: one per block))
    "fresh": ([37], [0], [[5, 6, 0]], [[9, 10, 0]]),
    "context": ([30], [40], [[5, 6, 7]], [[9, 10, 11]]),
    "batch": ([37, 12], [0, 64], [[5, 6, 0], [1, 2, 3]], [[9, 10, 0], [12, 13, 14]]),
    "batch_one_column": ([37, 12], [0, 30], [[5, 6, 0], [1, 2, 3]], [[9, 10, 0], [12, 13, 14]]),
}


@pytest.mark.parametrize("mode", ["align", "none"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_later_group_gets_what_its_own_build_would(builders, mode, case):
    first, second = builders[mode]
    query_lens, computed, table1, table2 = CASES[case]
    if mode == "none":                     # one state line per request, no per-block table
        table1, table2 = [row[:1] for row in table1], [row[:1] for row in table2]
    assert first.supports_update_block_table and second.supports_update_block_table
    built = first.build(0, common(query_lens, computed, table1))
    group2 = common(query_lens, computed, table2)
    want = type(second)._clef_build(second, 0, group2)                           # vLLM's own build
    got = second.update_block_table(built, group2.block_table_tensor, group2.slot_mapping)
    differs = [f.name for f in dataclasses.fields(want) if not same(getattr(want, f.name), getattr(got, f.name))]
    assert differs == []
    assert not same(built.prefill_state_indices, got.prefill_state_indices)       # the state lines did change
    assert got.chunk_indices is built.chunk_indices                             # and the rest is shared
    again = second.update_block_table(got, group2.block_table_tensor, group2.slot_mapping)   # from an update
    assert same(again.prefill_state_indices, want.prefill_state_indices)


def differing(want, got) -> list[str]:
    return [f.name for f in dataclasses.fields(want) if not same(getattr(want, f.name), getattr(got, f.name))]


@pytest.mark.parametrize("mode", ["align", "none"])
def test_a_single_prefill_of_a_length_seen_before_gets_what_vllms_own_build_would(builders, mode):
    """The first group's builder keeps the metadata of a one-sequence prefill and answers a later step of the
    same new-token count and context flag with it: after builds of other lengths, with other block tables
    and other context lengths, every field equals vLLM's own build of that step."""
    from clef_vllm.worker.fast import gdn_metadata

    builder = builders[mode][0]
    own = type(builder)._clef_build
    builder.__dict__.pop(gdn_metadata.MEMO, None)
    width = 1 if mode == "none" else 4

    def table(start):
        return [[start + i for i in range(width)]]

    steps = [([37], [0], table(5)), ([50], [0], table(9)), ([30], [40], table(13)), ([37], [0], table(17)),
             ([30], [70], table(21)), ([30], [0], table(25)), ([37], [0], table(29))]
    kept = {}
    reused_before, built_before = gdn_metadata.STATS["reused"], gdn_metadata.STATS["built"]
    for query_lens, computed, blocks in steps:
        step = common(query_lens, computed, blocks)
        got = builder.build(0, step)
        want = own(builder, 0, common(query_lens, computed, blocks))
        assert differing(want, got) == [], (query_lens, computed)
        key = (query_lens[0], computed[0] > 0)
        if key in kept:                                   # a hit: the kept tensors, this step's state lines
            assert got.chunk_indices is kept[key].chunk_indices and got.batch_ptr is kept[key].batch_ptr
            assert got.non_spec_query_start_loc is step.query_start_loc
        else:
            kept[key] = got
        assert got.__dict__[gdn_metadata.SEQ_LENS] is step.seq_lens   # later groups update from this step's
    assert set(builder.__dict__[gdn_metadata.MEMO]) == {(37, False), (50, False), (30, True), (30, False)}
    assert gdn_metadata.STATS["reused"] - reused_before == 3 and gdn_metadata.STATS["built"] - built_before == 4
    assert same(kept[(30, True)].has_initial_state, torch.tensor([True]))
    assert same(kept[(30, False)].has_initial_state, torch.tensor([False]))


def test_only_single_prefills_are_kept_and_the_least_recently_used_goes_first(builders, monkeypatch):
    from clef_vllm.worker.fast import gdn_metadata

    builder = builders["none"][0]
    own = type(builder)._clef_build
    builder.__dict__.pop(gdn_metadata.MEMO, None)
    batch = common([37, 12], [0, 64], [[5], [6]])
    assert differing(own(builder, 0, common([37, 12], [0, 64], [[5], [6]])), builder.build(0, batch)) == []
    decode = common([1], [40], [[7]])
    assert differing(own(builder, 0, common([1], [40], [[7]])), builder.build(0, decode)) == []
    assert builder.__dict__.get(gdn_metadata.MEMO, {}) == {}            # several sequences, a decode: not kept
    monkeypatch.setattr(gdn_metadata, "MEMO_SIZE", 2)
    for n in (20, 21, 20, 22):                                      # 20 used again: 21 is the oldest
        builder.build(0, common([n], [0], [[3]]))
    assert list(builder.__dict__[gdn_metadata.MEMO]) == [(20, False), (22, False)]
    spec = SimpleNamespace(use_spec_decode=True, use_full_cuda_graph=False)
    assert gdn_metadata.memo_key(spec, common([20], [0], [[3]]), (), {}) is None
    assert gdn_metadata.memo_key(builder, common([20], [0], [[3]]), (None, None), {"fast_build": True}) == (20, False)
    assert gdn_metadata.memo_key(builder, common([20], [0], [[3]]), (torch.ones(1),), {}) is None   # accepted tokens


def test_with_the_memo_off_every_step_is_vllms_own_build_and_nothing_is_kept(builders):
    from clef_vllm.worker.fast import gdn_metadata

    builder = builders["none"][0]
    own = type(builder)._clef_build
    builder.__dict__.pop(gdn_metadata.MEMO, None)
    try:
        assert gdn_metadata.install(memo=False)
        for n in (20, 20):
            step = common([n], [0], [[3]])
            got = builder.build(0, step)
            assert differing(own(builder, 0, common([n], [0], [[3]])), got) == []
            assert got.__dict__[gdn_metadata.SEQ_LENS] is step.seq_lens     # the shared build still works
        assert builder.__dict__.get(gdn_metadata.MEMO) is None
    finally:
        gdn_metadata.install()
    builder.build(0, common([20], [0], [[3]]))
    assert list(builder.__dict__[gdn_metadata.MEMO]) == [(20, False)]


def test_state_lines_read_from_one_column_are_what_vllm_gathers(builders):
    """``state_table`` against vLLM's ``mamba_get_block_table_tensor``: in ``align`` mode, rows whose lines
    sit in one column (one sequence, several at the same block, a padded row of length 0 at column 0) and
    rows that do not (vLLM's own answer), a column at the table's end, no host lengths; ``none`` mode."""
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

    from clef_vllm.worker.fast.gdn_metadata import state_table

    table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    for lens in ([37], [64], [65], [1], [320], [37, 40, 33, 64], [37, 100], [5, 0], [0, 0], [33, 0]):
        rows = table[:len(lens)]
        seq = torch.tensor(lens, dtype=torch.int32)
        for mode, builder in ((m, builders[m][0]) for m in ("align", "none")):
            want = mamba_get_block_table_tensor(rows, seq, builder.kv_cache_spec, mode)
            for cpu in (seq, None):
                got = state_table(builder, rows, seq, cpu)
                assert same(got, want), (lens, mode, cpu is None)
                assert mode == "none" or got[:, 0].is_contiguous()       # as vLLM's gather gives them


def test_a_step_of_one_column_does_no_gather(builders, monkeypatch):
    """In ``align`` mode a memo hit and the later groups' updates read the state line from the block table:
    vLLM's gather (seven GPU operations a group) is not called, and every field is still vLLM's own build."""
    import vllm.v1.attention.backends.utils as vllm_utils

    from clef_vllm.worker.fast import gdn_metadata

    first, second = builders["align"]
    first.__dict__.pop(gdn_metadata.MEMO, None)
    own = type(first)._clef_build
    first.build(0, common([37], [0], [[5, 6, 0]]))                   # kept: the next step of 37 tokens is a hit

    def no_gather(*args, **kwargs):
        raise AssertionError("mamba_get_block_table_tensor called")

    monkeypatch.setattr(vllm_utils, "mamba_get_block_table_tensor", no_gather)
    step, group2 = common([37], [0], [[7, 8, 0]]), common([37], [0], [[9, 10, 0]])
    got = first.build(0, step)
    later = second.update_block_table(got, group2.block_table_tensor, group2.slot_mapping)
    monkeypatch.undo()
    assert differing(own(first, 0, common([37], [0], [[7, 8, 0]])), got) == []
    assert differing(type(second)._clef_build(second, 0, common([37], [0], [[9, 10, 0]])), later) == []
    assert int(got.prefill_state_indices[0]) == 8 and int(later.prefill_state_indices[0]) == 10


def test_only_plain_steps_share_a_build():
    from clef_vllm.worker.fast.gdn_metadata import shareable, update_block_table

    assert shareable(SimpleNamespace(use_spec_decode=False, use_full_cuda_graph=False))
    assert not shareable(SimpleNamespace(use_spec_decode=True, use_full_cuda_graph=False))
    assert not shareable(SimpleNamespace(use_spec_decode=False, use_full_cuda_graph=True))
    foreign = SimpleNamespace(spec_sequence_masks=None)                        # no sequence lengths kept
    with pytest.raises(RuntimeError, match="did not build"):
        update_block_table(None, foreign, None, None)


def test_the_model_installs_it_before_vllm_makes_its_builders(tiny_release, monkeypatch):
    """The Clef model's constructor (in the engine process, before vLLM's KV-cache init makes the metadata
    builders) installs the shared build; nothing else does, so raw-vLLM baselines keep vLLM's own."""
    from clef_vllm.worker.fast import gdn_metadata

    calls = []
    monkeypatch.setattr(gdn_metadata, "install", lambda memo=True: calls.append(memo) or True)
    vllm_cpu.load_model(tiny_release)
    vllm_cpu.load_model(tiny_release, settings=WorkerSettings(gdn_metadata_memo=False))    # the option off
    assert calls == [True, False]
    # the plugin's entry point alone (every vLLM process, raw baselines included) leaves the builder alone
    code = ("from clef_vllm import register; register(); "
            "from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as B; "
            "print('_clef_shared' in B.__dict__, B.supports_update_block_table)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["False", "False"]

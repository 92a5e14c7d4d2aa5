"""clef_vllm.worker.gdn_metadata: vLLM's GDN metadata builder, taught ``update_block_table``, gives a later
KV-cache group exactly what its own build would, on CPU with vLLM 0.28's real builder."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from support import vllm_cpu

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
    from clef_vllm.worker import gdn_metadata

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
    want = second.build(0, group2)
    got = second.update_block_table(built, group2.block_table_tensor, group2.slot_mapping)
    differs = [f.name for f in dataclasses.fields(want) if not same(getattr(want, f.name), getattr(got, f.name))]
    assert differs == []
    assert not same(built.prefill_state_indices, got.prefill_state_indices)       # the state lines did change
    assert got.chunk_indices is built.chunk_indices                             # and the rest is shared
    again = second.update_block_table(got, group2.block_table_tensor, group2.slot_mapping)   # from an update
    assert same(again.prefill_state_indices, want.prefill_state_indices)


def test_only_plain_steps_share_a_build():
    from clef_vllm.worker.gdn_metadata import shareable, update_block_table

    assert shareable(SimpleNamespace(use_spec_decode=False, use_full_cuda_graph=False))
    assert not shareable(SimpleNamespace(use_spec_decode=True, use_full_cuda_graph=False))
    assert not shareable(SimpleNamespace(use_spec_decode=False, use_full_cuda_graph=True))
    foreign = SimpleNamespace(spec_sequence_masks=None)                        # no sequence lengths kept
    with pytest.raises(RuntimeError, match="did not build"):
        update_block_table(None, foreign, None, None)


def test_the_model_installs_it_before_vllm_makes_its_builders(tiny_release, monkeypatch):
    """The Clef model's constructor (in the engine process, before vLLM's KV-cache init makes the metadata
    builders) installs the shared build; nothing else does, so raw-vLLM baselines keep vLLM's own."""
    from clef_vllm.worker import gdn_metadata

    calls = []
    monkeypatch.setattr(gdn_metadata, "install", lambda: calls.append("install") or True)
    vllm_cpu.load_model(tiny_release)
    assert calls == ["install"]
    # the plugin's entry point alone (every vLLM process, raw baselines included) leaves the builder alone
    code = ("from clef_vllm import register; register(); "
            "from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as B; "
            "print('_clef_shared' in B.__dict__, B.supports_update_block_table)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["False", "False"]

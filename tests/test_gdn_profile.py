"""clef_vllm.worker.gdn_profile: the GDN prefill core run inside vLLM's profiling step, at its full size, in the
costliest split a step can have, only while the worker has armed it; and the worker arming it around vLLM's
memory profiling. vLLM's kernels are stand-ins here (they need a GPU); tests/gpu runs the real ones."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from clef_vllm.plan.graph_costs import worst_prefill_lengths as worst_lengths
from clef_vllm.worker import gdn_profile
from clef_vllm.worker.gdn_profile import GdnPeakProbe


class FakeGdnLayer:
    """The parts of vLLM's QwenGatedDeltaNetAttention the probe reads, recording the calls it gets."""

    num_k_heads, num_v_heads, tp_size, head_k_dim, head_v_dim = 4, 8, 2, 16, 16

    def __init__(self):
        self.A_log = torch.zeros(self.num_v_heads)
        self.dt_bias = torch.zeros(self.num_v_heads)
        self.warmups: list[int] = []
        self.rules: list[dict] = []

    def get_state_dtype(self):
        return torch.bfloat16, torch.float32

    def _warmup_prefill_kernels(self, qkv, v_dim):
        self.warmups.append(qkv.size(0))

    def chunk_gated_delta_rule(self, *, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                               chunk_indices, chunk_offsets, use_qk_l2norm_in_kernel):
        self.rules.append(dict(tokens=q.size(1), q=tuple(q.shape), v=tuple(v.shape), initial=tuple(initial_state.shape),
                               initial_dtype=initial_state.dtype, cu_seqlens=cu_seqlens.tolist(),
                               final=output_final_state, l2=use_qk_l2norm_in_kernel))
        return torch.zeros_like(v), torch.zeros(initial_state.shape, dtype=torch.float32)


def fake_prep(conv_out, a, b, layer):
    """fused_post_conv_prep's outputs: q, k (key heads), v (value heads), g, beta per token."""
    t, heads = conv_out.size(0), layer.num_v_heads // layer.tp_size
    key_heads = layer.num_k_heads // layer.tp_size
    q = conv_out.new_zeros(t, key_heads, layer.head_k_dim)
    return (q, q.clone(), conv_out.new_zeros(t, heads, layer.head_v_dim),
            torch.zeros(t, heads), conv_out.new_zeros(t, heads))


def test_the_costliest_split_is_one_token_past_a_chunk_per_sequence():
    lengths = worst_lengths(8192, 128)
    assert len(lengths) == 126 and sum(lengths) == 8192 and set(lengths[:-1]) == {65} and lengths[-1] == 67
    assert worst_lengths(8192, 4) == [65, 65, 65, 8192 - 195]       # --max-num-seqs bounds the sequences
    assert worst_lengths(100, 128) == [100] and worst_lengths(4096, 1) == [4096]


def test_the_probe_runs_the_core_once_at_the_steps_size_only_while_armed():
    layer, other = FakeGdnLayer(), FakeGdnLayer()
    probe = GdnPeakProbe(tokens=1024, max_sequences=8, prep=fake_prep)
    assert probe.install(None, layers=[layer, other]) and probe.install(None, layers=[layer, other])
    qkv = torch.ones(1024, 48, dtype=torch.bfloat16)
    layer._warmup_prefill_kernels(qkv, 0)                 # not armed: vLLM's own warm-up only
    assert layer.warmups == [1024] and layer.rules == [] and probe.runs == 0
    with probe.armed_for_profiling():
        layer._warmup_prefill_kernels(qkv[:512], 0)       # a smaller step (a graph-capture warm-up) does not run it
        layer._warmup_prefill_kernels(qkv, 0)
        layer._warmup_prefill_kernels(qkv, 0)             # once per profiling run
    assert layer.warmups == [1024, 512, 1024, 1024] and len(layer.rules) == 1 and probe.runs == 1
    rule = layer.rules[0]
    lengths = worst_lengths(1024, 8)
    assert rule["cu_seqlens"] == [0, 65, 130, 195, 260, 325, 390, 455, 1024] and rule["tokens"] == 1024
    assert rule["initial"] == (len(lengths), 4, 16, 16) and rule["initial_dtype"] == torch.float32
    assert rule["q"] == (1, 1024, 2, 16) and rule["v"] == (1, 1024, 4, 16) and rule["final"] and not rule["l2"]
    assert not probe.armed and other.warmups == [] and other.rules == []   # one layer is enough
    layer._warmup_prefill_kernels(qkv, 0)
    assert len(layer.rules) == 1                          # disarmed after the block


def test_the_worker_arms_the_probe_around_vllms_profiling(monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    from clef_vllm.worker import budget
    from clef_vllm.worker.fast import prefill_graphs

    layer = FakeGdnLayer()
    qkv = torch.ones(256, 48, dtype=torch.bfloat16)

    def vllm_profiling(self):                              # vLLM's profiling step reaching the GDN layer's warm-up
        layer._warmup_prefill_kernels(qkv, 0)
        return 4 << 30

    monkeypatch.setattr(Worker, "determine_available_memory", vllm_profiling)
    monkeypatch.setattr(prefill_graphs, "gdn_layers", lambda model: [layer])
    monkeypatch.setattr(gdn_profile, "vllm_prep", fake_prep)
    monkeypatch.setattr(budget, "process_memory", lambda: None)
    monkeypatch.setattr(budget.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(budget, "plugin_graph_bytes", lambda config: {})
    monkeypatch.setattr(budget, "runtime_excess_bytes", lambda config: 0)
    worker = budget.ClefWorker.__new__(budget.ClefWorker)
    worker.vllm_config = SimpleNamespace(additional_config={})
    worker.model_runner = SimpleNamespace(max_num_tokens=256, max_num_reqs=2, get_model=torch.nn.Module)
    worker.total_consumed, worker.cudagraph_memory_estimate = None, 0
    assert worker.determine_available_memory() > 0
    assert len(layer.rules) == 1 and layer.rules[0]["cu_seqlens"] == [0, 65, 256]
    layer._warmup_prefill_kernels(qkv, 0)                 # after the profiling: vLLM's warm-up alone
    assert len(layer.rules) == 1

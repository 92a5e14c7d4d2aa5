"""Whole-step graphs (clef_vllm.worker.fast.step_graphs, ``--prefill-graph-scope step``): which steps may use
one, the static inputs a replay reads and how each step refreshes them. The capture itself needs a GPU
(replays compared with vLLM's path there: bench/results/h200_9b_step_graph_probe_fresh.json)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS, GdnGraphRunner
from clef_vllm.worker.fast.step_graphs import (StepGraph, StepGraphRunner, groups, refresh, refresh_all, static_slots,
                                          step_reason)
from test_prefill_graphs import HV, DV, inputs, make_bucket, make_layer

PIECEWISE, NONE = "PIECEWISE", "NONE"


def fa(n, block=(5, 6)):
    """vLLM 0.28's own FA3 metadata for one prefill of ``n`` tokens."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    return FlashAttentionMetadata(num_actual_tokens=n, max_query_len=n, max_seq_len=n,
                                  query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                                  seq_lens=torch.tensor([n], dtype=torch.int32),
                                  block_table=torch.tensor([list(block) + [0] * 6], dtype=torch.int32),
                                  slot_mapping=torch.arange(n, dtype=torch.int64), use_cascade=False,
                                  common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
                                  suffix_kv_lens=None, scheduler_metadata=torch.zeros(3, dtype=torch.int32))


def gdn(n, line=2, has_init=False):
    """vLLM 0.28's own GDN metadata for one prefill of ``n`` tokens."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    return GDNAttentionMetadata(num_prefills=1, num_prefill_tokens=n, num_decodes=0, num_decode_tokens=0,
                                num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=n,
                                prefill_state_indices=torch.tensor([line], dtype=torch.int32),
                                prefill_has_initial_state=torch.tensor([has_init]))


def context(n, mode=PIECEWISE, **over):
    a, g = fa(n), gdn(n)
    md = {"layers.0.linear_attn": g, "layers.1.linear_attn": g, "layers.3.self_attn": a, "layers.7.self_attn": a}
    md.update(over)
    return SimpleNamespace(attn_metadata=md, cudagraph_runtime_mode=mode,
                           slot_mapping={"layers.3.self_attn": a.slot_mapping, "layers.7.self_attn": a.slot_mapping})


def test_steps_that_may_use_a_step_graph():
    def reason(ctx, size=448):
        return step_reason(ctx, DEFAULT_BUCKETS, 4, DEFAULT_BUCKETS, size, PIECEWISE)

    assert reason(context(400)) is None
    assert reason(context(400, mode=NONE)) == "not_piecewise"       # vLLM's profile, warm-up and capture runs
    assert reason(context(400), size=200) == "size"                 # padded to a size that is no bucket
    assert reason(context(200), size=256) is None
    assert reason(context(300)) == "size"                           # 300 real rows fit a smaller bucket
    batch = gdn(400)
    batch.num_prefills = 2
    assert reason(context(400, **{"layers.0.linear_attn": batch})) == "batch"
    cascade = fa(400)
    cascade.use_cascade = True
    assert reason(context(400, **{"layers.3.self_attn": cascade})) == "cascade"
    assert reason(context(400, **{"layers.5.mlp": SimpleNamespace()})) == "attention_backend"
    assert reason(SimpleNamespace(attn_metadata=None, cudagraph_runtime_mode=PIECEWISE)) == "no_metadata"
    ctx = context(400)
    assert list(groups(ctx.attn_metadata, "GDNAttentionMetadata")) == ["layers.0.linear_attn"]   # one per group


def test_static_slot_mappings_pad_with_no_write_rows():
    s = static_slots(torch.arange(5), 8)
    assert s.tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    refresh(s, torch.arange(3) + 10)
    assert s.tolist() == [10, 11, 12, -1, -1, -1, -1, -1]
    same = static_slots(torch.arange(8), 8)
    refresh(same, torch.arange(8) * 2)
    assert same.tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    with pytest.raises(ValueError, match="does not fit"):        # only a shorter slot mapping is padded
        refresh(torch.zeros(1, 12), torch.zeros(1, 13))
    with pytest.raises(ValueError, match="does not fit"):
        refresh(s, torch.arange(9))


def test_a_replay_refreshes_its_inputs_in_one_copy_per_dtype(monkeypatch):
    """Same-shaped contiguous pairs of a dtype go through one multi-tensor copy; a shorter slot mapping (padded
    with -1), a strided view (M-RoPE positions) and a pair of two dtypes are copied one by one, as before."""
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: calls.append(len(dst)) or real(dst, src))
    ids, qsl, line = torch.zeros(6, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    slots, short, flag = torch.zeros(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int64), torch.zeros(1, dtype=torch.bool)
    pos, cast = torch.zeros(3, 10, dtype=torch.int64)[:, :6], torch.zeros(2, dtype=torch.int64)
    refresh_all([(ids, torch.arange(6, dtype=torch.int32) + 1), (qsl, torch.tensor([0, 5], dtype=torch.int32)),
                 (line, torch.tensor([7], dtype=torch.int32)), (slots, torch.arange(6) + 10), (short, torch.arange(4)),
                 (flag, torch.tensor([True])), (pos, torch.arange(18).reshape(3, 6)), (cast, torch.tensor([3, 4], dtype=torch.int32))])
    assert sorted(calls) == [1, 1, 3]                    # int32 x3, int64 (slots alone: the others are not plain), bool
    assert ids.tolist() == [1, 2, 3, 4, 5, 6] and qsl.tolist() == [0, 5] and line.tolist() == [7]
    assert slots.tolist() == list(range(10, 16)) and short.tolist() == [0, 1, 2, 3, -1, -1] and flag.tolist() == [True]
    assert torch.equal(pos, torch.arange(18).reshape(3, 6)) and cast.tolist() == [3, 4]
    with pytest.raises(ValueError, match="does not fit"):
        refresh_all([(ids, torch.arange(7, dtype=torch.int32))])


def runner_with_bucket(size=16):
    gdn_runner = GdnGraphRunner(buckets=(size,))
    bucket = gdn_runner._buckets[size] = make_bucket(size)
    return gdn_runner, bucket


def test_a_step_graph_reads_static_inputs_that_each_step_refreshes():
    """The capture runs on static copies (FA3 metadata for the padded size: every row, the model's longest
    sequence, no ahead-of-time schedule); each replay first copies the step's ids, positions, FA3 tensors,
    slot mappings and GDN state lines into them, and points the GDN mask at the real rows."""
    gdn_runner, bucket = runner_with_bucket(16)
    graph = StepGraph(gdn_runner, max_len=4096)
    ctx = context(9)
    ids, pos = torch.arange(12), torch.arange(40).expand(3, 40).clone()[:, :12]   # positions: a view of a longer buffer
    md_all, slots = graph.statics(ctx, ids, pos)
    assert graph.pos.stride() == pos.stride() == (40, 1) and torch.equal(graph.pos, pos)
    static = md_all["layers.3.self_attn"]
    assert static is md_all["layers.7.self_attn"] and static is not ctx.attn_metadata["layers.3.self_attn"]
    assert (static.num_actual_tokens, static.max_query_len, static.max_seq_len) == (12, 12, 4096)
    assert static.scheduler_metadata is None and static.slot_mapping.tolist() == list(range(9)) + [-1] * 3
    assert slots["layers.3.self_attn"].tolist() == list(range(9)) + [-1] * 3
    # the layers of one KV-cache group share one slot mapping: one static, one copy per replay
    assert slots["layers.3.self_attn"] is slots["layers.7.self_attn"] and len(graph.slot_groups) == 1
    # GDN: a copy for the padded size too (vLLM's op slices and normalises num_actual_tokens rows)
    real_gdn, static_gdn = ctx.attn_metadata["layers.0.linear_attn"], md_all["layers.0.linear_attn"]
    assert static_gdn is md_all["layers.1.linear_attn"] and static_gdn is not real_gdn
    assert (static_gdn.num_actual_tokens, static_gdn.num_prefill_tokens) == (12, 12)
    assert real_gdn.num_actual_tokens == 9
    line, flag = gdn_runner.inline_sources[id(static_gdn)]
    assert line.tolist() == [2] and flag.tolist() == [False]
    # the capture itself writes no state: no KV slot, the GDN scratch line, no initial state
    flag.fill_(True)
    graph.write_nothing()
    assert static.slot_mapping.tolist() == [-1] * 12 and slots["layers.3.self_attn"].tolist() == [-1] * 12
    assert line.tolist() == [0] and flag.tolist() == [False]

    later = context(11, **{"layers.0.linear_attn": gdn(11, line=1, has_init=True),
                           "layers.1.linear_attn": gdn(11, line=1, has_init=True)})
    later.attn_metadata["layers.3.self_attn"].block_table[0, :2] = torch.tensor([8, 9])
    graph.feed(later, torch.arange(12) + 100, pos + 1, 11)
    assert graph.ids.tolist() == list(range(100, 112)) and torch.equal(graph.pos, pos + 1)
    assert static.query_start_loc.tolist() == [0, 11] and static.seq_lens.tolist() == [11]
    assert static.block_table[0, :2].tolist() == [8, 9] and static.slot_mapping.tolist() == list(range(11)) + [-1]
    assert line.tolist() == [1] and flag.tolist() == [True]
    assert bucket.length == 11 and bucket.real[:, 0].tolist() == [True] * 11 + [False] * 5
    graph.forget()
    assert bucket.length is None and bucket.fed is None
    # a step whose layers no longer share what they shared at capture does not fit the graph
    apart = context(11)
    apart.slot_mapping["layers.7.self_attn"] = apart.slot_mapping["layers.7.self_attn"].clone()
    with pytest.raises(ValueError, match="no longer share"):
        graph.feed(apart, torch.arange(12), pos, 11)


def test_the_runner_falls_back_until_every_gdn_layer_has_its_bucket_body(monkeypatch):
    import vllm.forward_context

    gdn_runner, bucket = runner_with_bucket(448)
    gdn_runner.prefixes = ["layers.0.linear_attn", "layers.1.linear_attn"]
    runner = StepGraphRunner(gdn_runner, max_len=4096)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ctx = context(400)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: ctx)
    from vllm.config import CUDAGraphMode

    ctx.cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
    ids, pos = torch.arange(448), torch.arange(448).expand(3, 448).clone()
    assert runner.run(lambda i, p: None, ids, pos) is None
    assert runner.stats.fallbacks == {"gdn_uncaptured": 1}          # this step's per-layer path captures them
    assert runner.run(lambda i, p: None, None, pos) is None and runner.stats.fallbacks["embeds"] == 1
    ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE
    assert runner.run(lambda i, p: None, ids, pos) is None and runner.stats.fallbacks["not_piecewise"] == 1

    class Captured:                                 # a captured size: the step's statics are fed, then replayed
        out = torch.ones(3)

        def __init__(self, fits=True):
            self.fits, self.seen, self.replayed = fits, None, False

        def feed(self, ctx, input_ids, positions, n):
            if not self.fits:
                raise ValueError("a step input of shape (1, 13) does not fit its static (1, 12)")
            self.seen = n

        def launch(self):
            self.replayed = True
            return self.out

        def forget(self):
            pass

    ctx.cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
    runner._graphs[(448, "fresh")] = graph = Captured()
    assert torch.equal(runner.run(lambda i, p: None, ids, pos), torch.ones(3))
    assert graph.seen == 400 and graph.replayed and runner.stats.replays == 1
    runner._graphs[(448, "fresh")] = Captured(fits=False)   # an input the capture did not foresee: falls back
    assert runner.run(lambda i, p: None, ids, pos) is None and runner.stats.fallbacks["inputs_changed"] == 1
    assert (448, "fresh") not in runner._graphs and runner._broken == {(448, "fresh"): "inputs_changed"}
    assert runner.run(lambda i, p: None, ids, pos) is None and runner.stats.fallbacks["inputs_changed"] == 2
    # a step with context (a later chunk, a cache hit) is another kind: its own graph, not the broken one
    ctx.attn_metadata["layers.3.self_attn"].max_seq_len = 1400
    runner._graphs[(448, "context")] = later = Captured()
    assert torch.equal(runner.run(lambda i, p: None, ids, pos), torch.ones(3)) and later.replayed
    assert runner.describe()["replays"] == 2 and runner.describe()["sizes"] == list(gdn_runner.buckets)
    assert (runner.describe()["fresh_graphs"], runner.describe()["context_graphs"]) == (0, 1)


def test_each_kind_of_step_captures_its_own_graph_for_fa3s_longest_sequence(monkeypatch):
    """A fresh step's graph gives FA3 the padded size as the longest sequence, a step with context the
    model's: FA3 sizes its work from that length, and a graph must never see a longer sequence."""
    import vllm.forward_context
    from vllm.config import CUDAGraphMode

    from clef_vllm.worker.fast import step_graphs

    gdn_runner, _ = runner_with_bucket(448)
    gdn_runner.prefixes = ["layers.0.linear_attn"]
    gdn_runner._bodies[("layers.0.linear_attn", 448, "core")] = object()
    runner = StepGraphRunner(gdn_runner, max_len=4096)
    captured = []

    def capture(self, ctx, input_ids, positions, n, forward, pool, none_mode):
        captured.append((self.max_len, n))
        self.captured_at = n

    monkeypatch.setattr(step_graphs.StepGraph, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ctx = context(400)
    ctx.cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: ctx)
    ids, pos = torch.arange(448), torch.arange(448).expand(3, 448).clone()
    assert step_graphs.step_kind(ctx.attn_metadata, 448) == "fresh"
    assert runner.run(lambda i, p: None, ids, pos) is None          # the capture's step runs the per-layer path
    ctx.attn_metadata["layers.3.self_attn"].max_seq_len = 448 + 400  # the same size after 448 tokens of context
    assert step_graphs.step_kind(ctx.attn_metadata, 448) == "context"
    assert runner.run(lambda i, p: None, ids, pos) is None
    assert captured == [(448, 400), (4096, 400)] and set(runner._graphs) == {(448, "fresh"), (448, "context")}
    assert runner.stats.captures == 2


def test_scope_step_is_an_engine_option_with_a_longer_warm_up(tiny_release):
    from clef_vllm.backends.options import OptionError
    from clef_vllm.backends.vllm_backend import engine_kwargs, warmup_lengths
    from clef_vllm.contract import WorkerSettings

    kw = engine_kwargs(tiny_release, prefill_graph_scope="step", max_model_len=1000, max_num_batched_tokens=1000)
    assert WorkerSettings.of(SimpleNamespace(**kw)).prefill_graphs.scope == "step"
    lengths = warmup_lengths(kw)
    buckets = WorkerSettings.of(SimpleNamespace(**kw)).prefill_graphs.buckets
    assert all(lengths.count(b) == 3 for b in buckets)      # GDN graphs, then the step graph, then a replay
    assert lengths == sorted(lengths)
    # vLLM pads a step to its next capture size: with step graphs those are the buckets above the smallest
    sizes = kw["compilation_config"]["cudagraph_capture_sizes"]
    assert [s for s in sizes if s > buckets[0]] == [b for b in buckets if b > buckets[0]]
    core = engine_kwargs(tiny_release, prefill_graph_scope="core", max_model_len=1000, max_num_batched_tokens=1000)
    assert 104 in core["compilation_config"]["cudagraph_capture_sizes"] and 104 not in sizes
    with pytest.raises(OptionError, match="no effect with 'prefill_graphs' off"):
        engine_kwargs(tiny_release, prefill_graphs=False, prefill_graph_scope="step")
    with pytest.raises(OptionError, match="no effect with 'enforce_eager' on") as refused:
        engine_kwargs(tiny_release, prefill_graph_scope="step", enforce_eager=True)
    assert refused.value.option == "prefill_graph_scope"
    assert engine_kwargs(tiny_release, enforce_eager=True)["enforce_eager"] is True     # core: still allowed
    for scope in ("layer", "step"):    # the graphs hold the Triton GDN kernels
        with pytest.raises(OptionError, match="no effect with 'gdn_prefill_backend' 'flashinfer'"):
            engine_kwargs(tiny_release, prefill_graph_scope=scope, gdn_prefill_backend="flashinfer")
    assert engine_kwargs(tiny_release, gdn_prefill_backend="flashinfer")["gdn_prefill_backend"] == "flashinfer"


def test_inline_bodies_write_the_state_line_from_the_static_source():
    """What a captured step runs for each GDN layer (CPU, no graph): the static source's state line, every
    padded row copied, exact on the real rows (see also tests/test_prefill_graphs.py)."""
    from support.gdn_reference import KERNELS
    from clef_vllm.worker.fast.prefill_graphs import single_sequence_core

    gdn_runner, bucket = runner_with_bucket(16)
    view = make_layer(False, seed=3)
    gdn_runner.kernels = KERNELS
    gdn_runner._views["l"] = view
    gdn_runner._bodies[("l", 16, "core")] = SimpleNamespace(replay=lambda: single_sequence_core(view, bucket, KERNELS))
    gdn_runner.inline = True
    md = gdn(9, line=0)
    gdn_runner.inline_sources[id(md)] = (torch.tensor([1], dtype=torch.int32), torch.tensor([False]))
    bucket.set_length(9)
    qkv, b, a = inputs(12, seed=8)
    found = (None, md, bucket, gdn_runner._bodies[("l", 16, "core")])
    out = torch.zeros(12, HV, DV)
    gdn_runner._replay(found, (("qkv", qkv), ("b", b), ("a", a)), out)
    assert view.ssm_state[1].abs().sum() > 0 and view.ssm_state[0].abs().sum() == 0


def test_the_default_scope_is_step_wherever_step_graphs_can_run(tiny_release):
    """``auto`` (the default) resolves to ``step``, or to ``core`` where step graphs cannot run (another GDN
    backend, --enforce-eager): a default never turns into a refusal, an explicit ``step`` there does."""
    from clef_vllm.backends.options import VllmOptions
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.contract import WorkerSettings

    def scope(**options):
        return WorkerSettings.of(SimpleNamespace(**engine_kwargs(tiny_release, **options))).prefill_graphs.scope

    assert VllmOptions().prefill_graph_scope == "auto" and VllmOptions().resolved_prefill_graph_scope == "step"
    assert scope() == "step" and scope(prefill_graph_scope="auto") == "step"
    assert scope(prefill_graph_scope="core") == "core" and scope(prefill_graph_scope="layer") == "layer"
    assert scope(gdn_prefill_backend="flashinfer") == "core"
    assert scope(enforce_eager=True) == "core"
    default = engine_kwargs(tiny_release, max_model_len=1000, max_num_batched_tokens=1000)
    step = engine_kwargs(tiny_release, prefill_graph_scope="step", max_model_len=1000, max_num_batched_tokens=1000)
    assert default["compilation_config"] == step["compilation_config"]      # the buckets alone above the smallest


# --------------------------------------------------------------------------- small batches, one sequence at a time


def test_a_split_plan_gives_each_sequence_its_bucket_and_kind():
    from clef_vllm.worker.fast.step_graphs import CONTEXT, FRESH, SPLIT_TOKENS, Part, split_plan

    buckets = (64, 128, 400, 448)
    plan = split_plan([0, 400, 790, 1210], [400, 390, 420 + 300], buckets, 4, 4)
    assert plan == [Part(0, 400, 400, FRESH), Part(400, 790, 400, FRESH), Part(790, 1210, 448, CONTEXT)]
    assert [p.tokens for p in plan] == [400, 390, 420]
    # a sequence whose context still fits its bucket takes the fresh graph (FA3's longest sequence is the size)
    assert split_plan([0, 100, 200], [100, 120], buckets, 4, 4)[1].kind == FRESH
    assert split_plan([0, 100], [100], buckets, 4, 4) == "split_metadata"           # one sequence: no split
    assert split_plan([0, 100, 200], [100], buckets, 4, 4) == "split_metadata"
    assert split_plan([0, 10, 20, 30, 40, 50], [10] * 5, buckets, 4, 4) == "split_seqs"
    assert split_plan([0, 10, 20, 30, 40, 50], [10] * 5, buckets, 4, 5) != "split_seqs"
    assert split_plan([0, 448, 896, 1344, 1792, 2240], [448] * 5, buckets, 4, 5) == "split_tokens"
    assert SPLIT_TOKENS == 2048 and split_plan([0, 100, 103], [100, 3], buckets, 4, 4) == "split_too_short"
    assert split_plan([0, 100, 600], [100, 500], buckets, 4, 4) == "split_too_long"


def batch_context(lens, lines, contexts=None, mode=PIECEWISE):
    """A step of several prefill sequences as vLLM 0.28 describes it (the GDN metadata with the host-side query
    start locations and sequence lengths clef_vllm.worker.fast.gdn_metadata keeps on it)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from clef_vllm.worker.fast.gdn_metadata import QUERY_START_CPU, SEQ_LENS_CPU

    contexts = contexts or [0] * len(lens)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    total, seq_lens = starts[-1], [c + n for c, n in zip(contexts, lens)]
    a = FlashAttentionMetadata(num_actual_tokens=total, max_query_len=max(lens), max_seq_len=max(seq_lens),
                               query_start_loc=torch.tensor(starts, dtype=torch.int32),
                               seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                               block_table=torch.tensor([[10 * i + 1, 10 * i + 2] + [0] * 6 for i in range(len(lens))],
                                                        dtype=torch.int32),
                               slot_mapping=torch.arange(total, dtype=torch.int64) + 1000, use_cascade=False,
                               common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
                               suffix_kv_lens=None, scheduler_metadata=None)
    g = GDNAttentionMetadata(num_prefills=len(lens), num_prefill_tokens=total, num_decodes=0, num_decode_tokens=0,
                             num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=total,
                             prefill_state_indices=torch.tensor(lines, dtype=torch.int32),
                             prefill_has_initial_state=torch.tensor([c > 0 for c in contexts]))
    g.__dict__[QUERY_START_CPU] = torch.tensor(starts, dtype=torch.int32)
    g.__dict__[SEQ_LENS_CPU] = torch.tensor(seq_lens, dtype=torch.int32)
    md = {"layers.0.linear_attn": g, "layers.1.linear_attn": g, "layers.3.self_attn": a, "layers.7.self_attn": a}
    return SimpleNamespace(attn_metadata=md, cudagraph_runtime_mode=mode,
                           slot_mapping={"layers.3.self_attn": a.slot_mapping + 5000,
                                         "layers.7.self_attn": None}), total


class Replayed:
    """A captured step graph on CPU: its replay writes what it read from the static inputs into its output rows
    (token id, state line, initial-state flag, block-table row, FA3 sequence length and query end, slot mappings)."""

    def __init__(self, graph):
        self.graph, self.replays = graph, 0

    def replay(self):
        g, self.replays = self.graph, self.replays + 1
        fa3 = g.attn["layers.3.self_attn"]
        line, flag = next(iter(g.lines.values()))
        (slots, _), = g.slot_groups
        cols = [g.ids.float(), line.float().expand(g.ids.shape[0]), flag.float().expand(g.ids.shape[0]),
                fa3.block_table[0, 0].float().expand(g.ids.shape[0]), fa3.seq_lens.float().expand(g.ids.shape[0]),
                fa3.query_start_loc[1].float().expand(g.ids.shape[0]), fa3.slot_mapping.float(), slots.float()]
        g.out.copy_(torch.stack(cols, dim=1))


def captured(gdn_runner, size, max_len):
    graph = StepGraph(gdn_runner, max_len)
    one = context(size - 3)
    one.slot_mapping["layers.7.self_attn"] = one.slot_mapping["layers.3.self_attn"]
    graph.statics(one, torch.arange(size), torch.arange(size).expand(3, size).clone())
    graph.out, graph.graph = torch.zeros(size, 8), None
    graph.graph = Replayed(graph)
    return graph


def test_a_small_batch_replays_each_sequences_step_graph_in_turn(monkeypatch):
    """Each sequence's rows, FA3 metadata row, slot mappings and state line go to its bucket's graph (fresh or
    with context), its output rows come back at its place in the step, vLLM's padding rows are zeros; a step
    that does not qualify runs vLLM's path."""
    import vllm.forward_context
    from vllm.config import CUDAGraphMode

    gdn_runner = GdnGraphRunner(buckets=(16, 32))
    for size in (16, 32):
        gdn_runner._buckets[size] = make_bucket(size)
    runner = StepGraphRunner(gdn_runner, max_len=4096, split_seqs=3)
    fresh16, context32 = captured(gdn_runner, 16, 16), captured(gdn_runner, 32, 4096)
    runner._graphs.update({(16, "fresh"): fresh16, (32, "context"): context32})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ctx, total = batch_context([9, 20, 5], lines=[3, 4, 5], contexts=[0, 40, 0], mode=CUDAGraphMode.PIECEWISE)
    ctx.slot_mapping["layers.7.self_attn"] = ctx.slot_mapping["layers.3.self_attn"]
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: ctx)
    ids = torch.arange(40) + 100                          # 34 real rows, padded by vLLM to 40
    pos = torch.arange(40).expand(3, 40).clone()
    out = runner.run(lambda i, p: pytest.fail("vLLM's path ran"), ids, pos)
    assert out.shape == (40, 8) and runner.split_steps == 1 and runner.split_replays == 3
    assert (fresh16.graph.replays, context32.graph.replays) == (2, 1)
    for (start, end), line, flag, block, seq_len in (((0, 9), 3, 0, 1, 9), ((9, 29), 4, 1, 11, 60),
                                                     ((29, 34), 5, 0, 21, 5)):
        rows = out[start:end]
        assert rows[:, 0].tolist() == list(range(100 + start, 100 + end))          # its own tokens
        assert set(rows[:, 1].tolist()) == {line} and set(rows[:, 2].tolist()) == {flag}
        assert set(rows[:, 3].tolist()) == {block} and set(rows[:, 4].tolist()) == {seq_len}
        assert set(rows[:, 5].tolist()) == {end - start}                           # FA3's query [0, n]
        assert rows[:, 6].tolist() == list(range(1000 + start, 1000 + end))        # KV writes: its slots only
        assert rows[:, 7].tolist() == list(range(6000 + start, 6000 + end))
    assert out[34:].eq(0).all()
    # the graphs' padded rows write no KV: -1 after the last part's rows
    assert fresh16.attn["layers.3.self_attn"].slot_mapping[5:].eq(-1).all()
    assert fresh16.slot_groups[0][0][5:].eq(-1).all()
    assert runner.describe()["split_steps"] == 1 and runner.describe()["split_seqs"] == 3

    def fallback(ctx_, expect):
        monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: ctx_)
        before = runner.split_steps
        assert runner.run(lambda i, p: None, ids, pos) is None
        assert runner.split_steps == before and runner.stats.fallbacks[expect] >= 1

    four, _ = batch_context([5, 5, 5, 5], lines=[1, 2, 3, 4], mode=CUDAGraphMode.PIECEWISE)
    fallback(four, "split_seqs")
    uncaptured, _ = batch_context([9, 20], lines=[1, 2], mode=CUDAGraphMode.PIECEWISE)   # (32, fresh): no graph
    fallback(uncaptured, "split_uncaptured")
    for off in (0, 1):                                    # --step-graph-split 0/1: a batch keeps vLLM's path
        runner.split_seqs = off
        ctx2, _ = batch_context([9, 5], lines=[1, 2], mode=CUDAGraphMode.PIECEWISE)
        fallback(ctx2, "batch")
    runner.split_seqs = 3
    # a part that does not fit its graph is found before any replay: nothing runs, vLLM's path does it all
    wide, _ = batch_context([9, 5], lines=[1, 2], mode=CUDAGraphMode.PIECEWISE)
    wide.slot_mapping["layers.7.self_attn"] = wide.slot_mapping["layers.3.self_attn"]
    wide.attn_metadata["layers.3.self_attn"].block_table = torch.zeros(2, 9, dtype=torch.int32)
    replays = fresh16.graph.replays
    fallback(wide, "split_inputs")
    assert fresh16.graph.replays == replays


def test_the_split_is_an_engine_option_for_whole_step_graphs(tiny_release):
    from clef_vllm.backends.options import OptionError
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.contract import DEFAULT_STEP_GRAPH_SPLIT, WorkerSettings

    def setting(**options):
        return WorkerSettings.of(SimpleNamespace(**engine_kwargs(tiny_release, **options))).prefill_graphs

    assert setting().split == DEFAULT_STEP_GRAPH_SPLIT == 4
    assert setting(step_graph_split=0).split == 0 and setting(step_graph_split=8).split == 8
    assert setting(prefill_graph_scope="core").split == 0
    with pytest.raises(OptionError, match="no effect with prefill graph scope 'core'") as refused:
        engine_kwargs(tiny_release, prefill_graph_scope="core", step_graph_split=2)
    assert refused.value.option == "step_graph_split"
    with pytest.raises(OptionError, match="no effect with 'prefill_graphs' off"):
        engine_kwargs(tiny_release, prefill_graphs=False, step_graph_split=2)

"""Prefill graphs (clef_vllm.worker.fast.prefill_graphs): bucket choice, fallback rules, padding exactness.

The graph body runs here with a plain-torch reference of the GDN kernels: padding a sequence to a
bucket must leave the real rows' outputs AND the stored conv / SSM states exactly as without
padding, with and without an initial state (a later chunk, a prefix-cache hit). The Triton
kernels and the capture itself are compared on the GPU (tests/gpu/vllm_parity.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from clef_vllm.worker.fast.prefill_graphs import (DEFAULT_BUCKETS, Bucket, GdnDims, GdnGraphRunner, choose_bucket,
                                             cudagraph_capture_sizes, fallback_reason, single_sequence_core,
                                             single_sequence_layer)
from support.gdn_reference import KERNELS

HK, HV, DK, DV, WIDTH, LINES = 2, 4, 8, 8, 4, 3
CONV_DIM = 2 * HK * DK + HV * DV
QKVZ_DIM = CONV_DIM + HV * DV          # the packed projection: [q k v | z]


@pytest.fixture(autouse=True)
def float32_default():
    """Every tensor here is fp32 (other tests load models under a bf16 default dtype)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(before)


def test_choose_bucket_is_the_smallest_that_fits():
    buckets = (64, 128, 512)
    assert choose_bucket(1, buckets) == 64
    assert choose_bucket(64, buckets) == 64
    assert choose_bucket(65, buckets) == 128
    assert choose_bucket(512, buckets) == 512
    assert choose_bucket(513, buckets) is None
    assert list(DEFAULT_BUCKETS) == sorted(DEFAULT_BUCKETS)
    from clef_vllm.backends.options import bucket_list
    from clef_vllm.worker.fast.prefill_graphs import LINEAR_BUCKETS, default_buckets

    for linear, buckets in LINEAR_BUCKETS.items():                 # valid --prefill-graph-buckets values
        assert bucket_list(buckets) == buckets and default_buckets(linear) == buckets
    assert default_buckets(None) == LINEAR_BUCKETS["bf16"]          # unquantized
    assert default_buckets("compressed-tensors") == DEFAULT_BUCKETS  # not swept


def metadata(**over):
    md = dict(num_prefills=1, num_decodes=0, num_spec_decodes=0, spec_sequence_masks=None, num_prefill_tokens=400,
              num_actual_tokens=400, prefill_state_indices=torch.tensor([7], dtype=torch.int32))
    md.update(over)
    return SimpleNamespace(**md)


@pytest.mark.parametrize("over, reason", [
    ({}, None),
    ({"num_prefills": 2}, "batch"),
    ({"num_prefills": 0}, "no_prefill"),
    ({"num_decodes": 1}, "decodes"),
    ({"spec_sequence_masks": torch.ones(1, dtype=torch.bool)}, "speculative"),
    ({"num_actual_tokens": 3, "num_prefill_tokens": 3}, "too_short"),
    ({"num_actual_tokens": 5000, "num_prefill_tokens": 5000}, "too_long"),
    ({"num_actual_tokens": 410}, "padded_metadata"),
    ({"prefill_state_indices": torch.tensor([1, 2], dtype=torch.int32)}, "state_indices"),
])
def test_fallback_reasons(over, reason):
    assert fallback_reason(metadata(**over), DEFAULT_BUCKETS, min_tokens=4) == reason
    assert fallback_reason(None, DEFAULT_BUCKETS, 4) == "no_metadata"


def test_capture_sizes_cover_the_buckets_and_vllms_own_sizes():
    sizes = cudagraph_capture_sizes(8192, max_num_seqs=128)
    assert sizes == sorted(set(sizes))
    assert {1, 2, 4, 8, 248, 256} <= set(sizes)
    assert set(DEFAULT_BUCKETS) <= set(sizes)
    assert 272 not in sizes and 400 not in sizes          # vLLM stops at 2 x 128 = 256 here
    assert max(cudagraph_capture_sizes(1000)) <= 1000
    # scope "step": above the smallest bucket only buckets, so a single-sequence step pads to one
    step = cudagraph_capture_sizes(8192, max_num_seqs=256, between_buckets=False)
    assert [s for s in step if s > 64] == [b for b in DEFAULT_BUCKETS if b > 64]
    assert {1, 2, 4, 8, 56, 64} <= set(step) and 104 not in step and 400 not in step
    assert 400 in cudagraph_capture_sizes(8192, max_num_seqs=256)      # vLLM's own sizes go up to 512 here


def make_layer(dim_first: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.zeros(LINES, CONV_DIM, WIDTH - 1) if dim_first else torch.zeros(LINES, WIDTH - 1, CONV_DIM)
    return SimpleNamespace(
        conv_weight=torch.randn(CONV_DIM, WIDTH, generator=g) * 0.5, conv_bias=None, activation="silu",
        conv_state_raw=raw, conv_state=raw if dim_first else raw.transpose(-1, -2), conv_dim_first=dim_first,
        ssm_state=torch.zeros(LINES, HV, DV, DK), A_log=torch.randn(HV, generator=g) * 0.3,
        dt_bias=torch.randn(HV, generator=g) * 0.3, num_k_heads=HK, head_k_dim=DK, head_v_dim=DV,
        qkv_size=CONV_DIM, value_size=HV * DV, norm_weight=1 + 0.1 * torch.randn(DV, generator=g))


def make_bucket(size: int) -> Bucket:
    return Bucket(size, GdnDims(CONV_DIM, HV, DV, WIDTH), "cpu", torch.float32, None, None, None)


def run_bucket(layer, size, rows, line, has_init, garbage=None, body=single_sequence_core):
    """What the runner does around a replay: copy the real rows in (over stale ``garbage`` rows of earlier
    requests, if given), run ``body`` on the bucket, read the real rows. ``rows``: buffer name -> tensor."""
    n = next(iter(rows.values())).shape[0]
    bucket = make_bucket(size)
    if body is single_sequence_layer:
        bucket.packed(QKVZ_DIM, 2 * HV)
    for (name, given), stale in zip(rows.items(), garbage or [None] * len(rows)):
        if stale is not None:
            getattr(bucket, name).copy_(stale[:size])
        getattr(bucket, name)[:n] = given
    bucket.set_length(n)
    bucket.lines.fill_(line)
    bucket.has_init.fill_(has_init)
    body(layer, bucket, KERNELS)
    return bucket.out[:n].clone()


def run_chunk(layer, size, qkv, b, a, line, has_init, garbage=None):
    return run_bucket(layer, size, {"qkv": qkv, "b": b, "a": a}, line, has_init, garbage)


def inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, CONV_DIM, generator=g), torch.randn(n, HV, generator=g), torch.randn(n, HV, generator=g))


@pytest.mark.parametrize("dim_first", [False, True])
@pytest.mark.parametrize("n, size", [(13, 16), (13, 64), (64, 64), (5, 128), (70, 96)])
def test_padding_changes_neither_outputs_nor_states(dim_first, n, size):
    exact, padded = make_layer(dim_first), make_layer(dim_first)
    qkv, b, a = inputs(n, seed=n)
    garbage = inputs(size, seed=99)
    want = run_chunk(exact, n, qkv, b, a, line=1, has_init=False)
    got = run_chunk(padded, size, qkv, b, a, line=1, has_init=False, garbage=tuple(t * 50 for t in garbage))
    # fp32 CPU kernels vectorise differently for different lengths: equal up to ~1e-8 here; a padding
    # bug (an unmasked gate, a stale conv tail) moves them by O(1e-1).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded.ssm_state, exact.ssm_state, rtol=1e-5, atol=1e-6)
    assert torch.equal(padded.conv_state_raw, exact.conv_state_raw)
    assert padded.ssm_state[1].abs().sum() > 0 and padded.ssm_state[[0, 2]].abs().sum() == 0   # only its line


@pytest.mark.parametrize("dim_first", [False, True])
def test_chunks_with_initial_state_equal_one_pass(dim_first):
    """A prompt prefilled in two padded chunks (the second reading the first's states, as a later
    chunk or a prefix-cache hit does) equals the same prompt in one unpadded pass."""
    qkv, b, a = inputs(40, seed=3)
    whole = make_layer(dim_first)
    want = run_chunk(whole, 40, qkv, b, a, line=2, has_init=False)
    split = make_layer(dim_first)
    first = run_chunk(split, 64, qkv[:23], b[:23], a[:23], line=2, has_init=False, garbage=inputs(64, 5))
    second = run_chunk(split, 64, qkv[23:], b[23:], a[23:], line=2, has_init=True, garbage=inputs(64, 6))
    torch.testing.assert_close(torch.cat([first, second]), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.ssm_state, whole.ssm_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(split.conv_state_raw, whole.conv_state_raw)


def test_masked_rows_leave_the_recurrent_state_bit_identical():
    """g = 0 and beta = 0 make a row an exact identity of the delta rule's state."""
    g = torch.Generator().manual_seed(4)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 20, HK, DK, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(1, 20, HV, DV, generator=g)
    gate = -torch.rand(1, 20, HV, generator=g)
    beta = torch.rand(1, 20, HV, generator=g)
    h0 = torch.randn(1, HV, DV, DK, generator=g)
    o_short, s_short = KERNELS.rule(q[:, :12], k[:, :12], v[:, :12], gate[:, :12], beta[:, :12], h0, None, None, None)
    gate[:, 12:] = 0
    beta[:, 12:] = 0
    v[:, 12:] *= 1e3                                  # padded rows hold anything finite
    o_long, s_long = KERNELS.rule(q, k, v, gate, beta, h0, None, None, None)
    assert torch.equal(o_long[:, :12], o_short)
    assert torch.equal(s_long, s_short)


def test_without_initial_state_a_stale_line_is_ignored():
    layer = make_layer(False)
    layer.ssm_state.fill_(float("nan"))             # whatever the line held before
    layer.conv_state_raw.fill_(float("nan"))
    qkv, b, a = inputs(20, seed=8)
    out = run_chunk(layer, 64, qkv, b, a, line=0, has_init=False)
    assert torch.isfinite(out).all() and torch.isfinite(layer.ssm_state[0]).all()
    assert torch.isfinite(layer.conv_state_raw[0]).all()


def test_bucket_length_mask_and_tail():
    bucket = make_bucket(16)
    bucket.set_length(10)
    assert bucket.real[:, 0].tolist() == [True] * 10 + [False] * 6
    assert bucket.tail.tolist() == [7, 8, 9]


def test_padded_gate_inputs_are_minus_inf_whatever_a_longer_step_left():
    """A padded row's gate inputs are -inf, so the gating prep gives it g = 0 and beta = 0 exactly (no mask
    multiply in the body): set_length restores them after a longer step wrote real rows there, and a
    shorter step after a longer one on the same bucket equals the same rows unpadded."""
    layer, exact = make_layer(False), make_layer(False)
    bucket = make_bucket(16)
    assert torch.isneginf(bucket.a).all() and torch.isneginf(bucket.b).all()     # from the start
    q, k, v, g, beta = KERNELS.prep(torch.zeros(2, CONV_DIM), torch.full((2, HV), float("-inf")),
                                    torch.full((2, HV), float("-inf")), layer)
    assert torch.equal(g, torch.zeros_like(g)) and torch.equal(beta, torch.zeros_like(beta))
    for n, seed in ((14, 1), (9, 2)):                   # a longer step, then a shorter one, same bucket
        qkv, b, a = inputs(n, seed=seed)
        bucket.set_length(n)
        bucket.qkv[:n], bucket.b[:n], bucket.a[:n] = qkv, b, a
        bucket.lines.fill_(1)
        bucket.has_init.fill_(False)
        single_sequence_core(layer, bucket, KERNELS)
        assert torch.isneginf(bucket.a[n:]).all() and torch.isneginf(bucket.b[n:]).all()
    want = run_chunk(exact, 9, qkv, b, a, line=1, has_init=False)
    torch.testing.assert_close(bucket.out[:9], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.ssm_state[1], exact.ssm_state[1], rtol=1e-5, atol=1e-6)
    bucket.packed(QKVZ_DIM, 2 * HV)                     # scope "layer": the packed gate inputs too
    assert torch.isneginf(bucket.ba).all()
    bucket.qkvz.fill_(1.0)
    bucket.ba.fill_(1.0)
    bucket.set_length(5)
    assert torch.isneginf(bucket.ba[5:]).all() and (bucket.ba[:5] == 1).all()


# --------------------------------------------------------------------------- scope "layer"


def run_layer_chunk(layer, size, qkvz, ba, line, has_init, garbage=None):
    """Scope "layer": the packed rows in, split + core + norm on the bucket."""
    return run_bucket(layer, size, {"qkvz": qkvz, "ba": ba}, line, has_init, garbage, body=single_sequence_layer)


def packed_inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, QKVZ_DIM, generator=g), torch.randn(n, 2 * HV, generator=g)


@pytest.mark.parametrize("dim_first", [False, True])
@pytest.mark.parametrize("n, size", [(13, 64), (64, 64)])
def test_layer_scope_equals_split_core_norm_unpadded(dim_first, n, size):
    """Scope "layer" (the packed op in one graph) on a padded bucket gives what vLLM's packed op gives on
    the real rows: split, the core, the gated norm; the stored states are the real tokens' states."""
    qkvz, ba = packed_inputs(n, seed=n)
    exact = make_layer(dim_first)
    mixed, gate, b, a = KERNELS.split(qkvz, ba, exact)
    core = run_chunk(exact, n, mixed, b, a, line=2, has_init=False)
    want = torch.empty_like(core)
    KERNELS.norm(core, gate, want, exact)
    padded = make_layer(dim_first)
    garbage = tuple(t * 50 for t in packed_inputs(size, seed=77))
    got = run_layer_chunk(padded, size, qkvz, ba, line=2, has_init=False, garbage=garbage)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded.ssm_state, exact.ssm_state, rtol=1e-5, atol=1e-6)
    assert torch.equal(padded.conv_state_raw, exact.conv_state_raw)


def test_layer_scope_second_chunk_reads_the_first_chunks_states():
    """Two padded "layer" chunks (the second with an initial state) equal one unpadded pass."""
    qkvz, ba = packed_inputs(40, seed=5)
    whole = make_layer(False)
    want = run_layer_chunk(whole, 40, qkvz, ba, line=1, has_init=False)
    split = make_layer(False)
    first = run_layer_chunk(split, 64, qkvz[:23], ba[:23], line=1, has_init=False, garbage=packed_inputs(64, 6))
    second = run_layer_chunk(split, 64, qkvz[23:], ba[23:], line=1, has_init=True, garbage=packed_inputs(64, 7))
    torch.testing.assert_close(torch.cat([first, second]), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.ssm_state, whole.ssm_state, rtol=1e-5, atol=1e-5)


def test_runner_scope_is_checked():
    assert GdnGraphRunner(scope="layer").scope == "layer"
    assert GdnGraphRunner().describe()["scope"] == "core"
    with pytest.raises(ValueError, match="choose from core, layer"):
        GdnGraphRunner(scope="model")


# --------------------------------------------------------------------------- the runner around a replay


class FakeGraph:
    """Stands in for a captured CUDA graph on CPU: a replay runs the body and records the state line and
    initial-state flag the bucket held at that moment."""

    def __init__(self, body, bucket, log):
        self.body, self.bucket, self.log = body, bucket, log

    def replay(self):
        self.log.append((int(self.bucket.lines[0]), bool(self.bucket.has_init[0])))
        self.body()


def test_a_replay_always_uses_its_steps_state_line_copied_once_per_step_and_group(monkeypatch):
    """The state line and initial-state flag are copied into the bucket once per (step, KV-cache group),
    not per layer; a new step, another group's metadata, a metadata object vLLM reused in a later step,
    and a capture in mid-step (it overwrites them with the scratch line) all copy them again."""
    import vllm.forward_context

    from clef_vllm.worker.fast import prefill_graphs

    runner = GdnGraphRunner(buckets=(16,), kernels=KERNELS)
    runner._pool = object()                      # no CUDA pool on CPU; capture_graph is replaced below
    bucket = runner._buckets[16] = make_bucket(16)
    used: list[tuple[int, bool]] = []
    captured_on = []                             # the state line a capture ran on

    def capture(body, pool):
        captured_on.append(int(bucket.lines[0]))
        return FakeGraph(body, bucket, used), body()

    monkeypatch.setattr(prefill_graphs, "capture_graph", capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    copies = []
    real_copy = bucket.lines.copy_
    bucket.lines.copy_ = lambda src: (copies.append(int(src[0])), real_copy(src))[1]
    layers = {}
    for i in range(3):
        prefix = f"model.layers.{i}.linear_attn"
        runner._views[prefix] = make_layer(False, seed=i)
        layers[prefix] = SimpleNamespace(prefix=prefix, gdn_prefill_backend="triton")
        if i < 2:                                 # layer 2 has no graph yet: it is captured mid-step
            runner._graphs[(prefix, 16, "core")] = FakeGraph(
                lambda v=runner._views[prefix]: single_sequence_core(v, bucket, KERNELS), bucket, used)

    def md(line, has_init):
        return SimpleNamespace(num_prefills=1, num_decodes=0, num_spec_decodes=0, spec_sequence_masks=None,
                               num_prefill_tokens=9, num_actual_tokens=9,
                               prefill_state_indices=torch.tensor([line], dtype=torch.int32),
                               prefill_has_initial_state=torch.tensor([has_init]))

    def step(metadata, names):
        ctx = SimpleNamespace(attn_metadata=metadata)      # vLLM makes a new forward context every forward
        monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: ctx)
        for name in names:
            qkv, b, a = inputs(9, seed=len(used))
            assert runner.run(layers[name], qkv, b, a, torch.zeros(9, HV, DV))

    l0, l1, l2 = layers
    one = md(2, False)
    step({l0: one, l1: one}, [l0, l1])                      # one group: copied once for both layers
    assert used == [(2, False), (2, False)] and copies == [2]
    other = md(1, True)
    step({l0: one, l1: other}, [l0, l1])                    # a new step, two groups: copied for each
    assert used[2:] == [(2, False), (1, True)] and copies == [2, 2, 1]
    other.prefill_state_indices.fill_(2)                    # vLLM reused a metadata object in a later step
    step({l0: other}, [l0])
    assert used[4:] == [(2, True)] and copies[3:] == [2]
    step({l0: one, l2: one}, [l0, l2])                      # layer 2 is captured between the two replays
    assert (l2, 16, "core") in runner._graphs and runner.stats.captures == 1
    assert captured_on == [prefill_graphs.SCRATCH_LINE]     # the capture ran on the scratch line...
    assert used[5:] == [(2, False), (2, False)] and copies[4:] == [2, 2]   # ...and the replay after it did not
    assert runner.stats.replays == 7

    # Inline (inside a graph that encloses whole steps): the captured body runs instead of a replay, and
    # a capturing stream is no reason to fall back; a layer captured without a body falls back.
    runner.inline = True
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    view = runner._views[l2]
    view.ssm_state.zero_()
    before = len(used)
    step({l2: md(1, False), l0: md(1, False)}, [l2])
    assert len(used) == before and runner.stats.replays == 8          # no graph replayed; the body ran
    assert view.ssm_state[1].abs().sum() > 0 and view.ssm_state[0].abs().sum() == 0
    qkv, b, a = inputs(9, seed=1)
    assert not runner.run(layers[l0], qkv, b, a, torch.zeros(9, HV, DV))
    assert runner.stats.fallbacks["inline_uncaptured"] == 1
    # The enclosing graph's protocol: the state line comes from the static source registered for the
    # group's metadata (not from the metadata), every given (padded) row is copied in and out, and the
    # bucket's length is left as the caller set it.
    group = md(1, False)
    runner.inline_sources[id(group)] = (torch.tensor([2], dtype=torch.int32), torch.tensor([False]))
    view.ssm_state.zero_()
    bucket.set_length(9)
    ctx = SimpleNamespace(attn_metadata={l2: group})
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: ctx)
    qkv, b, a = inputs(12, seed=5)                       # 9 real rows padded to 12 by vLLM
    # Inside a step graph the padded rows hold whatever the graph's memory held: FA3 writes no row after
    # the last sequence's, so they can be NaN or Inf (seen in the tiny parity's warm-up on a GPU).
    # The delta rule mixes rows through products (0 * NaN is NaN), so such rows are replaced on the way in:
    # zeros for the conv input, -inf for the gate inputs (g = 0 and beta = 0 for a padded row).
    for t, junk in ((qkv, float("nan")), (b, float("inf")), (a, float("-inf"))):
        t[9:] = junk
    out = torch.full((12, HV, DV), float("nan"))
    assert runner.run(layers[l2], qkv, b, a, out)
    assert view.ssm_state[2].abs().sum() > 0 and view.ssm_state[1].abs().sum() == 0
    assert torch.isfinite(view.ssm_state[2]).all() and torch.isfinite(out).all() and bucket.length == 9
    assert torch.equal(bucket.qkv[:9], qkv[:9]) and not bucket.qkv[9:12].any()
    assert torch.isneginf(bucket.a[9:12]).all() and torch.isneginf(bucket.b[9:12]).all()
    exact = make_layer(False, seed=2)                    # the 9 real rows alone, unpadded
    want = run_chunk(exact, 9, qkv[:9], b[:9], a[:9], line=2, has_init=False)
    torch.testing.assert_close(out[:9], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(view.ssm_state[2], exact.ssm_state[2], rtol=1e-5, atol=1e-6)
    assert torch.equal(view.conv_state_raw[2], exact.conv_state_raw[2])

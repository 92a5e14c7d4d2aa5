"""The in-worker pooler (clef_vllm/worker/pooler.py) through vLLM's own pooling metadata, with synthetic hidden
states: chunked prefill, preemption, vLLM's warm-up calls, bad specs, the head-graph runner and the row grid,
the request trace's step marks, the head spec's wire format, and the reference backend's head on the same
hidden states."""

from __future__ import annotations

import contextlib
import struct

import pytest
import torch

from support import vllm_cpu

pytest.importorskip("vllm")
pytestmark = pytest.mark.usefixtures("cpu_shims")



def _requests():
    from clef_vllm.schema.dialects import parse_request

    bodies = [
        {"model": "m", "state": "Checkout fails for every customer.",
         "questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
                       "team": {"type": "choice", "criteria": {"billing": "Payments", "technical": "Outages"}}}},
        {"model": "m", "state": {"invoice": {"total": 1250.0, "status": "overdue"}, "notes": ["late"] * 12},
         "questions": {"sev": {"type": "score", "criteria": ["none", "minor", "major", "critical"]}}},
        {"model": "m", "state": "short",
         "questions": {"a": {"type": "noul"}, "b": {"type": "choice", "criteria": {"x": None, "y": 1, "z": [2]}},
                       "c": {"type": "score", "criteria": ["lo", "hi"]}}},
    ]
    return [parse_request(b) for b in bodies]


def _specs_and_hidden(encoder, hidden_size):
    from clef_vllm.model.features import HeadSpec

    specs = [HeadSpec.from_encoded(encoder.encode(r)) for r in _requests()]
    g = torch.Generator().manual_seed(3)
    hidden = [torch.randn(s.num_tokens, hidden_size, generator=g).to(torch.bfloat16) for s in specs]
    return specs, hidden


def _unchunked(model, specs, hidden):
    from clef_vllm.model.features import RecordAccumulator, accumulate, decide_records

    out = []
    for spec, h in zip(specs, hidden):
        acc = RecordAccumulator(spec)
        accumulate(model.head, h, [(acc, 0, spec.num_tokens, 0)])
        out.append(decide_records(model.head, model.lm_table, [acc])[0])
    return out


@torch.inference_mode()
def test_pooler_chunked_prefill_matches_single_pass(release_model, encoder):
    from vllm.v1.pool.metadata import PoolingStates

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    expected = _unchunked(m, specs, hidden)
    la, lb, lc = (s.num_tokens for s in specs)
    states = [PoolingStates() for _ in specs]
    # step 1: A[0:40], B[0:100]       (both partial)
    # step 2: A[40:], B[100:150], C[0:] (A and C finish)
    # step 3: B[150:]                  (B finishes)
    steps = [
        ([0, 1], [(0, 40), (0, 100)]),
        ([0, 1, 2], [(40, la), (100, 150), (0, lc)]),
        ([1], [(150, lb)]),
    ]
    results = {}
    for step, (which, ranges) in enumerate(steps):
        x = torch.cat([hidden[i][a:b] for i, (a, b) in zip(which, ranges)])
        md = vllm_cpu.pooling_metadata([specs[i] for i in which], [b - a for a, b in ranges], [b for _, b in ranges],
                       [states[i] for i in which])
        out = m.pooler(x, md)
        for i, (_, b), o in zip(which, ranges, out):
            if b < specs[i].num_tokens:
                assert o is None, f"partial prefill of request {i} must return None (step {step})"
            else:
                assert o is not None and o.dtype == torch.float32 and o.shape == (specs[i].num_options,)
                results[i] = o
    for i in range(3):
        torch.testing.assert_close(results[i], expected[i], atol=2e-3, rtol=0)
        assert torch.all(results[i] > 0)


def test_the_pooler_marks_each_step_in_the_request_trace(release_model, encoder, tmp_path, monkeypatch):
    """With ``CLEF_VLLM_TRACE`` on, the model's forward writes ``step_forward``, the pooler ``step_head`` when
    it begins and ``step_pooled`` when it returns (request ``*``): the trace summary splits a one-step
    request's engine time with them."""
    import json

    from clef_vllm.util import trace
    from vllm.v1.pool.metadata import PoolingStates

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    md = vllm_cpu.pooling_metadata(specs, [s.num_tokens for s in specs], [s.num_tokens for s in specs],
                                   [PoolingStates() for _ in specs])
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(trace, "PATH", str(path))
    out = m.pooler(torch.cat(hidden), md)
    assert all(o is not None for o in out)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["request"]) for e in events] == [("step_head", "*"), ("step_pooled", "*")]
    assert events[0]["t"] <= events[1]["t"]
    # and the model's forward writes step_forward before the backbone runs (here a stand-in model)
    from types import SimpleNamespace

    from clef_vllm.worker.model import ClefFlashForDecision

    seen = []
    stand_in = SimpleNamespace(_steps=0, _step_media=False, step_graphs=None, graph_runners=dict, _gdn_tuning=None,
                               model=lambda *a: seen.append(path.read_text().count("step_forward")) or "hidden")
    assert ClefFlashForDecision.forward(stand_in, torch.zeros(4, dtype=torch.long), torch.arange(4)) == "hidden"
    assert seen == [1]
    monkeypatch.setattr(trace, "PATH", None)
    m.pooler(torch.cat(hidden), md)
    ClefFlashForDecision.forward(stand_in, torch.zeros(4, dtype=torch.long), torch.arange(4))
    assert len(path.read_text().splitlines()) == 3                 # off: nothing written


@torch.inference_mode()
@contextlib.contextmanager
def _float32_head(m):
    """``m``'s head in float32 inside (padding must then be exact up to float32 rounding), its dtype after."""
    dtype = m.head.dtype
    m.head.float()
    try:
        yield
    finally:
        m.head.to(dtype)


def _three_chunked_steps(m, specs, hidden) -> dict:
    """The three requests of :func:`_specs_and_hidden` through ``m``'s pooler in three chunked steps (step 1:
    A[0:40], B[0:100]; step 2: the rest of A, B[100:150], all of C; step 3: the rest of B): each answer by
    request index."""
    from vllm.v1.pool.metadata import PoolingStates

    la, lb, lc = (s.num_tokens for s in specs)
    steps = [([0, 1], [(0, 40), (0, 100)]), ([0, 1, 2], [(40, la), (100, 150), (0, lc)]), ([1], [(150, lb)])]
    states, results = [PoolingStates() for _ in specs], {}
    for which, ranges in steps:
        x = torch.cat([hidden[i][a:b] for i, (a, b) in zip(which, ranges)])
        md = vllm_cpu.pooling_metadata([specs[i] for i in which], [b - a for a, b in ranges],
                                       [b for _, b in ranges], [states[i] for i in which])
        results.update((i, o) for i, o in zip(which, m.pooler(x, md)) if o is not None)
    return results


def test_pooler_with_head_graphs_answers_chunked_steps_of_several_requests_like_the_eager_head(release_model,
                                                                                            encoder):
    """The real pooler, real encoded requests, chunked: step 2 finishes two requests, step 3 one. With a
    head-graph runner for up to 4 requests per step (a CPU stand-in for the CUDA graphs) every answer is
    the eager pooler's, and the runner graphed both finishing steps after one self-check per bucket. The
    head runs in float32 here, so padding must be exact up to float32 rounding (in bf16 the padded shapes
    round differently: tests/test_head_graphs.py bounds that)."""
    from support.graph_runner import CpuGraphRunner

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    with _float32_head(m):
        eager = _three_chunked_steps(m, specs, hidden)
        # memory buckets up to 512 rows: these requests' 256-333 (larger buckets are captured for nothing)
        runner = m.pooler.head_graphs = CpuGraphRunner(m.head, max_memory=512, max_records=4)
        try:
            graphed = _three_chunked_steps(m, specs, hidden)
        finally:
            m.pooler.head_graphs = None
    assert sorted(graphed) == [0, 1, 2]
    for i in range(3):
        torch.testing.assert_close(graphed[i], eager[i], atol=1e-5, rtol=0)
    info = runner.describe()
    # 2 steps + one self-check per record bucket (1, 2, 4), all at the first finishing step
    assert info["replays"] == 2 + 3 and not info["failed"] and not info["fallbacks"]


@torch.inference_mode()
def test_pooler_with_the_row_grid_runs_every_gemm_at_a_grid_count_and_answers_as_without(release_model, encoder):
    """``--gemm-row-grid``: the real pooler over chunked steps of several requests with its row grid on (as after
    the GPU warm-up): every GEMM of the per-token stage and the eager head runs at a grid row count (recorded
    at the aten level), and each answer is the pooler's without the grid (float32 head: up to rounding)."""
    from clef_vllm.worker.fast.gemm_warmup import GridRows
    from support.gemm_shapes import GemmShapes

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    with _float32_head(m):
        plain = _three_chunked_steps(m, specs, hidden)
        grid = m.pooler.row_grid = GridRows(1024)
        try:
            with GemmShapes() as seen:
                gridded = _three_chunked_steps(m, specs, hidden)
        finally:
            m.pooler.row_grid = None
    assert sorted(gridded) == [0, 1, 2] and grid.padded > 0
    assert seen.seen and all(rows in set(grid.grid) for *_, rows in seen.seen)
    for i in range(3):
        torch.testing.assert_close(gridded[i], plain[i], atol=1e-5, rtol=0)


def test_the_wire_spec_round_trips_packed_and_refuses_what_it_did_not_write(encoder):
    """A head spec crosses to the engine core as one int32 buffer (plus the state cache's limit and keys): it
    comes back equal, vLLM's deep copy of the parameters shares the buffer instead of copying ints one by
    one, and a damaged wire raises one of the errors the pooler turns into a NaN answer."""
    from clef_vllm.backends.vllm_backend import pooling_params
    from clef_vllm.contract import PARAMS_KEY
    from clef_vllm.model.features import HeadSpec

    for request in _requests():
        encoded = encoder.encode(request)
        for spec in (HeadSpec.from_encoded(encoded), HeadSpec.from_encoded(encoded, state_keys=True)):
            wire = spec.to_wire()
            assert HeadSpec.from_wire(wire) == spec
            assert set(wire) == ({"a", "r", "k"} if spec.reuse_limit else {"a"})
    assert spec.reuse_limit and spec.state_keys                               # the keyed case ran
    params = pooling_params(spec)
    copy = params.clone()
    assert copy.extra_kwargs[PARAMS_KEY]["a"] is params.extra_kwargs[PARAMS_KEY]["a"]
    assert HeadSpec.from_wire(copy.extra_kwargs[PARAMS_KEY]) == spec
    from vllm import PoolingParams
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    sent = MsgpackDecoder(PoolingParams).decode(MsgpackEncoder().encode(params))   # vLLM's IPC encoding
    assert HeadSpec.from_wire(sent.extra_kwargs[PARAMS_KEY]) == spec
    packed = spec.to_wire()["a"]
    header = struct.unpack("<4i", packed[:16])
    for damaged in ({"a": packed[:-2]}, {"a": packed[:-4]}, {"a": packed + packed[-4:]}, {"a": packed[:12]},
                    {"a": struct.pack("<4i", header[0], -1, 0, 0)}, {"a": "text"}, {"b": packed}):
        with pytest.raises((KeyError, TypeError, ValueError)):
            HeadSpec.from_wire(damaged)


@torch.inference_mode()
def test_pooler_handles_warmup_calls_without_params_and_bad_specs(release_model, encoder):
    from vllm.v1.pool.metadata import PoolingStates

    from clef_vllm.model.features import HeadSpec

    m = release_model
    # vLLM's dummy run: PoolingParams(task="plugin") only, many short requests
    n = [64, 64, 1, 200]
    md = vllm_cpu.pooling_metadata([None] * 4, n, n, [PoolingStates() for _ in n])
    out = m.pooler(torch.randn(sum(n), m.config.hidden_size).to(torch.bfloat16), md)
    assert [o.numel() for o in out] == [9, 9, 1, 9]  # synthetic 3-field spec; 1 value for a 1-token prompt
    # a malformed spec never crashes the worker: that request gets NaN
    spec = HeadSpec.from_encoded(encoder.encode(_requests()[0]))
    bad = HeadSpec(spec.num_tokens, spec.type_ids, ((0, spec.num_tokens + 5),), spec.option_spans,
                   spec.options_per_field, spec.lexical_ids)
    md = vllm_cpu.pooling_metadata([bad, spec], [bad.num_tokens, spec.num_tokens], [bad.num_tokens, spec.num_tokens],
                   [PoolingStates(), PoolingStates()])
    out = m.pooler(torch.randn(2 * spec.num_tokens, m.config.hidden_size).to(torch.bfloat16), md)
    assert torch.isnan(out[0]).all()
    assert out[1].shape == (spec.num_options,) and torch.isfinite(out[1]).all()


@torch.inference_mode()
def test_pooler_gives_the_head_graphs_every_step_that_finishes_client_requests(release_model, encoder):
    """The head-graph runner sees every step that finishes client requests (its answer is theirs; it
    picks the steps it can graph); a step with vLLM's own warm-up requests runs the eager head."""
    from vllm.v1.pool.metadata import PoolingStates

    class Runner:
        def __init__(self):
            self.options = []

        def decide(self, batch):
            self.options.append(len(batch.layout.option_field))
            return torch.full((len(batch.layout.option_field),), 7.0)

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    runner = Runner()
    m.pooler.head_graphs = runner
    try:
        n = specs[0].num_tokens
        out = m.pooler(hidden[0], vllm_cpu.pooling_metadata([specs[0]], [n], [n], [PoolingStates()]))[0]
        assert runner.options == [specs[0].num_options] and torch.equal(out, torch.full_like(out, 7.0))
        md = vllm_cpu.pooling_metadata([None], [64], [64], [PoolingStates()])
        out = m.pooler(torch.randn(64, m.config.hidden_size).to(torch.bfloat16), md)[0]
        assert len(runner.options) == 1 and torch.isfinite(out).all() and (out < 1).all()
        lens = [s.num_tokens for s in specs[:2]]
        md = vllm_cpu.pooling_metadata(specs[:2], lens, lens, [PoolingStates(), PoolingStates()])
        out = m.pooler(torch.cat(hidden[:2]), md)
        assert runner.options[1:] == [specs[0].num_options + specs[1].num_options]
        assert [len(o) for o in out] == [specs[0].num_options, specs[1].num_options]
        assert all(torch.equal(o, torch.full_like(o, 7.0)) for o in out)
        md = vllm_cpu.pooling_metadata([specs[0], None], [n, 64], [n, 64], [PoolingStates(), PoolingStates()])
        out = m.pooler(torch.cat([hidden[0], torch.randn(64, m.config.hidden_size).to(torch.bfloat16)]), md)
        assert len(runner.options) == 2 and all((o < 1).all() for o in out)      # with a warm-up request: eager
    finally:
        m.pooler.head_graphs = None


@torch.inference_mode()
def test_pooler_restarts_a_preempted_request(release_model, encoder):
    from vllm.v1.pool.metadata import PoolingStates

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    spec, h = specs[0], hidden[0]
    st = PoolingStates()
    assert m.pooler(h[:30], vllm_cpu.pooling_metadata([spec], [30], [30], [st]))[0] is None
    # preempted: the scheduler recomputes the prompt from position 0
    out = m.pooler(h, vllm_cpu.pooling_metadata([spec], [spec.num_tokens], [spec.num_tokens], [st]))[0]
    torch.testing.assert_close(out, _unchunked(m, [spec], [h])[0], atol=2e-3, rtol=0)


@torch.inference_mode()
def test_pooler_output_equals_reference_head_on_same_hidden_states(release_model, tiny_release, encoder):
    """The worker-side head and the reference backend's head are the same computation."""
    from clef_vllm.backends.reference import ReferenceBackend
    from clef_vllm.model.features import HeadSpec
    from vllm.v1.pool.metadata import PoolingStates

    ref = ReferenceBackend(tiny_release, device="cpu")
    encoded = [encoder.encode(r) for r in _requests()]
    hidden = [ref.hidden_states([e])[0] for e in encoded]
    want = ref.decide_batch(encoded)
    specs = [HeadSpec.from_encoded(e) for e in encoded]
    md = vllm_cpu.pooling_metadata(specs, [s.num_tokens for s in specs], [s.num_tokens for s in specs],
                   [PoolingStates() for _ in specs])
    got = release_model.pooler(torch.cat(hidden), md)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=0)

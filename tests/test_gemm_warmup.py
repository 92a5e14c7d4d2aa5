"""``--gemm-warmup`` (clef_vllm/worker/fast/gemm_warmup.py): the head's GEMM shapes, and its matmul attentions, over a
grid of row counts.

Whether it removes CUDA's mid-step kernel loads is a GPU measurement (the lazy loads in a
profiled step's trace); here: the grid, that the shapes it runs are every GEMM shape the head's real work issues
(the eager head and the per-token stage, recorded at the aten level), that it runs them all, that
``--gemm-row-grid`` (:class:`GridRows`) makes every GEMM of that work run at a grid row count with the same
answers, and that the options reach the worker.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from clef_vllm.model.features import decide_records
from clef_vllm.model.tables import DenseTable
from clef_vllm.testing.head_cases import SMALL, VOCAB, finished, random_head, random_record
from clef_vllm.worker.fast.gemm_warmup import ROW_RATIO, GridRows, linear_shapes, row_grid, warm_gemm_kernels
from support.gemm_shapes import GemmShapes


def test_row_grid_covers_one_to_max_geometrically():
    grid = row_grid(16384)
    assert grid[0] == 1 and grid[-1] == 16384 and grid == sorted(set(grid))
    assert all(b / a <= ROW_RATIO + 0.5 / a + 1e-9 or b == a + 1 or b == 16384 for a, b in zip(grid, grid[1:]))
    assert len(grid) < 100                       # ~90 row counts to 16k: a second or so of GEMMs on a GPU
    assert row_grid(1) == [1] and row_grid(3) == [1, 2, 3]


def test_the_warmup_runs_every_gemm_shape_the_head_issues():
    """Several records of different sizes through the per-token stage and the eager head: every (in, out)
    of their GEMMs is among the warm-up's shapes, and the warm-up runs each at every grid row count."""
    head = random_head(SMALL)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size))
    rng = random.Random(5)
    records = [random_record(rng, rng.randint(1, 4), rng.randint(40, 90), SMALL.hidden_size) for _ in range(3)]
    with GemmShapes() as real:
        decide_records(head, table, finished(head, records), None)
    shapes = linear_shapes(head)
    assert {(i, o) for i, o, _ in real.seen} <= {(i, o) for i, o, _ in shapes}
    # the attentions see the records' memory padded to the longest: up to records x longest rows
    assert max(rows for *_, rows in real.seen) == len(records) * max(r[0].shape[0] for r in records)
    with GemmShapes() as warm:
        report = warm_gemm_kernels(head, 256, head.dtype, "cpu")
    grid = row_grid(256)
    assert report == {**report, "shapes": len(shapes), "row_counts": len(grid), "gemms": len(shapes) * len(grid)}
    assert sorted(warm.seen) == sorted((i, o, m) for i, o, _ in shapes for m in grid)


def test_running_out_of_memory_stops_the_warmup_not_the_step(monkeypatch, caplog):
    """The warm-up runs inside a real step on the memory the KV cache left: an out-of-memory error in it
    is reported (a warning, ``stopped`` with how far it got) and swallowed, so the step goes on."""
    import logging

    import clef_vllm.worker.fast.gemm_warmup as warmup

    head = random_head(SMALL)
    calls = {"n": 0}
    linear = torch.nn.functional.linear

    def failing(x, w, b=None):
        calls["n"] += 1
        if calls["n"] > 7:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return linear(x, w, b)

    monkeypatch.setattr(warmup.F, "linear", failing)
    with caplog.at_level(logging.WARNING, logger="clef_vllm"):
        report = warm_gemm_kernels(head, 256, head.dtype, "cpu")
    assert report["gemms"] == 7 and report["stopped"].startswith("out of memory after 7 GEMMs (CUDA out of memory")
    assert "clef GEMM warm-up stopped" in caplog.text and "--gemm-warmup off" in caplog.text
    monkeypatch.setattr(warmup.F, "linear", linear)
    assert "stopped" not in warm_gemm_kernels(head, 16, head.dtype, "cpu")


def test_the_warmup_runs_the_heads_matmul_attentions_over_long_memories(monkeypatch):
    """The matmul route's batched GEMMs (a few records over 1,024 keys or more) are warmed too: at every grid row
    count that takes the route, for 4, 16 and 64 queries and 1, 2, 4 ... up to the most records that take it,
    with the head's own layout (views of the projections' outputs)."""
    from clef_vllm.model.head import MATMUL_MIN_KEYS, attention_route
    import clef_vllm.worker.fast.gemm_warmup as warmup
    from clef_vllm.worker.fast.gemm_warmup import attention_shapes

    release = attention_shapes(16, 64, 16384)                 # the release head at the default context
    assert {q for _, q, _ in release} == {4, 16, 64} and max(r for r, _, _ in release) == 7
    assert min(k for *_, k in release) >= MATMUL_MIN_KEYS and max(k for *_, k in release) == 16384
    assert all(attention_route(r, 16, q, k, 64) == "matmul" for r, q, k in release)
    for q, k in {(q, k) for _, q, k in release}:              # the most records that take the route is included
        most = max(r for r, q2, k2 in release if (q2, k2) == (q, k))
        assert attention_route(most + 1, 16, q, k, 64) == "fused"
    assert attention_shapes(16, 64, 1000) == []               # no memory long enough: nothing to warm

    head = random_head(SMALL)
    calls = []
    real = warmup.matmul_attention

    def spy(q, k, v, keep):
        calls.append((q.shape[0], q.shape[2], k.shape[2]))
        assert k.transpose(1, 2).is_contiguous() and keep.all()   # [records, keys, heads x dim] viewed per head
        return real(q, k, v, keep)

    monkeypatch.setattr(warmup, "matmul_attention", spy)
    report = warm_gemm_kernels(head, 1200, head.dtype, "cpu")
    expected = attention_shapes(SMALL.heads, SMALL.width // SMALL.heads, 1200)
    assert expected and calls == expected
    assert report["gemms"] == len(linear_shapes(head)) * len(row_grid(1200)) + 2 * len(expected)


def test_linear_shapes_include_the_packed_attention_projections():
    head = random_head(SMALL)
    shapes = linear_shapes(head)
    width = SMALL.width
    assert (width, width, True) in shapes                      # the attentions' q/k/v (and out_proj)
    assert (SMALL.hidden_size, width, False) in shapes         # the memory projection
    assert len(shapes) == len(set(shapes))


def test_gemm_warmup_reaches_the_worker_unless_turned_off(tiny_release):
    import pytest

    from clef_vllm.backends.options import OptionError
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.contract import WorkerSettings

    def settings(**options):
        return WorkerSettings.of(SimpleNamespace(**engine_kwargs(tiny_release, **options)))

    default = settings()
    assert default.gemm_warmup is True and default.gemm_row_grid is True and default.gemm_warmup_rows is None
    off = settings(gemm_warmup=False)
    assert off.gemm_warmup is False and off.gemm_row_grid is False
    warm_only = settings(gemm_row_grid=False)
    assert warm_only.gemm_warmup is True and warm_only.gemm_row_grid is False
    with pytest.raises(OptionError, match="gemm_row_grid"):        # it would do nothing without the warm-up
        engine_kwargs(tiny_release, gemm_warmup=False, gemm_row_grid=False)


def test_grid_rows_pads_a_count_between_grid_points_to_the_next_one():
    grid = GridRows(16384)
    assert grid.grid == row_grid(16384)
    assert [grid.target(n) for n in (1, 12, 13, 14, 400, 16217, 16384, 20000)] == [1, 12, 14, 14, 406, 16384, 16384,
                                                                                   20000]
    assert all(grid.target(n) == n for n in grid.grid)
    assert all(n <= grid.target(n) <= n * ROW_RATIO + 1 for n in range(1, 16385))


def test_grid_rows_runs_the_heads_gemms_at_grid_counts_with_the_same_answers():
    """The per-token stage and the eager head of several records inside :class:`GridRows`: every GEMM they
    issue (recorded at the aten level) runs at a row count of the grid, counts above it run as they are, and
    the memory rows, span sums and probabilities equal those computed without it."""
    head = random_head(SMALL)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size))
    rng = random.Random(11)
    records = [random_record(rng, rng.randint(1, 4), rng.randint(40, 90), SMALL.hidden_size) for _ in range(5)]
    plain = decide_records(head, table, finished(head, records), None)
    grid = GridRows(256)
    with GemmShapes() as seen:
        with grid:
            accs = finished(head, records)
        probs = decide_records(head, table, accs, None, eager=grid)
    on_grid = set(grid.grid)
    assert seen.seen and all(rows in on_grid or rows > 256 for *_, rows in seen.seen)
    assert any(rows > 256 for *_, rows in seen.seen)            # 5 records' memory: above this grid, as it is
    assert grid.padded > 0 and grid.gemms >= len(seen.seen) and 0 < grid.extra_rows
    assert len(probs) == len(plain)
    for p, q in zip(probs, plain):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # the memory rows too: one step's per-token stage with and without the grid
    hidden = torch.cat([r[0] for r in records])
    with torch.no_grad():
        states, memory = head.encode_tokens(hidden)
        with GridRows(1024) as padded:
            states2, memory2 = head.encode_tokens(hidden)
    assert padded.padded == (0 if hidden.shape[0] in padded.grid else 1)
    assert memory2.shape == memory.shape and memory2.is_contiguous()
    torch.testing.assert_close(memory2, memory, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states2, states)


def test_grid_rows_keeps_shapes_bias_and_leading_dimensions():
    """A padded ``F.linear`` returns exactly the unpadded result's shape and values for 1-, 2- and 3-D inputs,
    with and without a bias, and leaves every other function alone."""
    torch.manual_seed(0)
    weight, bias = torch.randn(6, 5), torch.randn(6)
    grid = GridRows(64)
    for x in (torch.randn(5), torch.randn(13, 5), torch.randn(3, 5, 5), torch.randn(13, 5).t().contiguous().t()[:, :5]):
        for b in (None, bias):
            want = torch.nn.functional.linear(x, weight, b)
            with grid:
                got = torch.nn.functional.linear(x, weight, b)
                other = torch.cat([x.reshape(-1), x.reshape(-1)])
            assert got.shape == want.shape and other.shape == (2 * x.numel(),)
            torch.testing.assert_close(got, want)
    assert grid.padded == 6 and grid.extra_rows == 6          # 13 -> 14 (twice over), 15 -> 16: with and without bias


def test_grid_rows_runs_a_gemm_unpadded_when_its_padded_copy_does_not_fit(monkeypatch):
    """The padded copy is memory vLLM's profiling did not see: when it cannot be had, the GEMM runs at its own
    row count (the answer the same), counted, and the step goes on."""
    torch.manual_seed(1)
    x, weight = torch.randn(13, 5), torch.randn(6, 5)
    want = torch.nn.functional.linear(x, weight)

    def no_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.Tensor, "new_empty", no_memory)
    grid = GridRows(64)
    with grid:
        got = torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(got, want)
    assert grid.unpadded == 1 and grid.padded == 0 and grid.gemms == 1


def test_the_pooler_turns_the_row_grid_on_only_after_a_whole_warmup(monkeypatch):
    """``--gemm-row-grid``: the pooler runs its GEMMs on the grid once the warm-up has run every count, not when
    the warm-up stopped (the counts it did not reach would load their kernels mid-step anyway) nor when asked not to."""
    import clef_vllm.worker.pooler as pooler_mod

    head = random_head(SMALL)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # no GPU here: the step's device
    for wanted, report, expect in ((True, {}, True), (True, {"stopped": "out of memory"}, False), (False, {}, False)):
        monkeypatch.setattr(pooler_mod, "warm_gemm_kernels", lambda *a, _r=report: dict(_r))
        pooler = pooler_mod.ClefPooler(head, table, gemm_warmup_rows=512, gemm_row_grid=wanted)
        pooler._warm_gemms(torch.device("cuda"))
        assert pooler.gemm_warmup_rows is None
        assert (pooler.row_grid is not None) is expect
        if expect:
            assert pooler.row_grid.grid == row_grid(512)

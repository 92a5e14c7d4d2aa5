"""``--gemm-warmup`` (clef_vllm/worker/gemm_warmup.py): the head's GEMM shapes, and its matmul attentions, over a
grid of row counts.

Whether it removes CUDA's mid-step kernel loads is a GPU measurement (bench/step_timeline.py --gaps on a
profiled step); here: the grid, that the shapes it runs are every GEMM shape the head's real work issues
(the eager head and the per-token stage, recorded at the aten level), that it runs them all, and that the
option reaches the worker.
"""

from __future__ import annotations

import random

import torch

from clef_vllm.features import decide_records
from clef_vllm.tables import DenseTable
from clef_vllm.testing.head_cases import SMALL, VOCAB, finished, random_head, random_record
from clef_vllm.worker.gemm_warmup import ROW_RATIO, linear_shapes, row_grid, warm_gemm_kernels
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

    import clef_vllm.worker.gemm_warmup as warmup

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
    import clef_vllm.worker.gemm_warmup as warmup
    from clef_vllm.head import MATMUL_MIN_KEYS, attention_route
    from clef_vllm.worker.gemm_warmup import attention_shapes

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
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.contract import GEMM_WARMUP_KEY

    assert engine_kwargs(tiny_release)["additional_config"][GEMM_WARMUP_KEY] is True
    assert GEMM_WARMUP_KEY not in engine_kwargs(tiny_release, gemm_warmup=False).get("additional_config", {})

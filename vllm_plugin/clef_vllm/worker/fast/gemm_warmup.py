"""Load the joint head's GEMM kernels at start-up, not in the middle of a step.

CUDA loads a kernel when it is first launched (lazy loading, CUDA's default since 12.2), and the
load waits until the GPU has run everything already queued. cuBLAS picks a GEMM kernel by the
GEMM's shape, and the head's GEMMs take a new row count nearly every step: the memory projection
runs on all of a step's tokens, the evidence and decoder layers' projections on the memory rows of
the requests it finishes. Profiled at 64 concurrent short decisions, a
kernel cuBLAS had not used before stopped the engine's host for 104-304 ms once a step, with the
GPU then idle for the head's and the next step's launches. Loading every kernel up front
(``CUDA_MODULE_LOADING=EAGER``) is no way out: it took 5 min 43 s to create an engine's CUDA
context on an H200.

So, with ``--gemm-warmup`` (on by default), the first step that reaches the head runs each distinct linear
shape of the head (in and out features, bias) over a grid of row counts, 1 to the most rows a
step can give it, each count :data:`ROW_RATIO` times the last: cuBLAS meets its shapes, and CUDA
loads its kernels, while the GPU has nothing else queued (the eager head pads a group of records
to its longest, at most twice their real rows: :func:`clef_vllm.model.features.padding_groups`). Nothing of it reaches an answer (the
inputs and weights are zeros of the head's dtype, the outputs are dropped). A row count between
two grid points may still get a kernel of its own: a profiled step still has lazy loads (at c=64: 1-3
a step with it, 4-6 without; ``bench/results/h200_9b_bf16_c64_gemmwarm_timeline.txt``).

The head's attentions over a long memory run as batched GEMMs too (:func:`clef_vllm.model.head.matmul_attention`,
a few records' queries over 1,024 keys or more): the warm-up runs them at the memory grid's row counts from
:data:`~clef_vllm.model.head.MATMUL_MIN_KEYS` on, for 4, 16 and 64 queries and 1, 2, 4 ... and the most records
that take that route, laid out as the head lays them out (views of its projections' outputs).

A row count between two grid points may still get a kernel of its own, and the head's GEMMs take a new row
count nearly every step. So with ``--gemm-row-grid`` (on by default, with the warm-up) the worker runs the head's GEMMs
outside its CUDA graphs inside :class:`GridRows`: each ``F.linear`` over a row count between two grid points runs on
its rows padded up to the next one (at most :data:`ROW_RATIO` times as many), and only its real rows are kept.
Every GEMM row is computed from its own input row alone, so the padding changes no other row; cuBLAS then only
ever meets the row counts the warm-up ran.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from clef_vllm.model.head import MATMUL_MAX_TILES, attention_route, matmul_attention

log = logging.getLogger("clef_vllm")

#: Each row count of the grid is at least this many times the previous one.
ROW_RATIO = 1.125
#: Query counts of the head's attentions the warm-up runs on the matmul route (field and option slots).
ATTENTION_QUERIES = (4, 16, 64)


def row_grid(max_rows: int, ratio: float = ROW_RATIO) -> list[int]:
    """Row counts 1 ... ``max_rows``, each at least ``ratio`` times the last (and at least one more)."""
    rows, m = [], 1
    while m < max_rows:
        rows.append(m)
        m = max(m + 1, int(m * ratio + 0.5))
    rows.append(max_rows)
    return rows


def linear_shapes(module: nn.Module) -> list[tuple[int, int, bool]]:
    """The distinct ``(in_features, out_features, has_bias)`` of ``module``'s linear layers, in order: its
    ``nn.Linear`` modules and the query, key and value projections of its attentions (one packed
    ``in_proj_weight`` of three square matrices, run with ``F.linear``)."""
    seen: dict[tuple[int, int, bool], None] = {}
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            seen[(layer.in_features, layer.out_features, layer.bias is not None)] = None
        packed = getattr(layer, "in_proj_weight", None)
        if isinstance(packed, torch.Tensor):
            seen[(packed.shape[1], packed.shape[0] // 3, getattr(layer, "in_proj_bias", None) is not None)] = None
    return list(seen)


def attention_shapes(heads: int, head_dim: int, max_rows: int) -> list[tuple[int, int, int]]:
    """The ``(records, queries, keys)`` the warm-up runs :func:`~clef_vllm.model.head.matmul_attention` at: every
    grid row count up to ``max_rows`` that takes the matmul route, for :data:`ATTENTION_QUERIES` queries and
    1, 2, 4 ... records up to the most that take it."""
    out = []
    for keys in row_grid(max_rows):
        for queries in ATTENTION_QUERIES:
            taking = [r for r in range(1, MATMUL_MAX_TILES + 1)
                      if attention_route(r, heads, queries, keys, head_dim) == "matmul"]
            if taking:    # the route holds up to some number of records: powers of two up to it, and it
                records = {r for r in taking if r & (r - 1) == 0} | {taking[-1]}
                out.extend((r, queries, keys) for r in sorted(records))
    return out


def _attention_inputs(records: int, queries: int, keys: int, heads: int, head_dim: int, dtype, device):
    """Zero ``q, k, v`` and an all-true mask in the head's layout (views of ``[records, n, heads * head_dim]``)."""
    def heads_view(n):
        return torch.zeros(records, n, heads * head_dim, dtype=dtype, device=device).view(
            records, n, heads, head_dim).transpose(1, 2)

    keep = torch.ones(records, 1, 1, keys, dtype=torch.bool, device=device)
    return heads_view(queries), heads_view(keys), heads_view(keys), keep


def warm_gemm_kernels(module: nn.Module, max_rows: int, dtype: torch.dtype, device) -> dict:
    """Run every linear shape of ``module`` at every row count of :func:`row_grid` (``max_rows``) on
    ``device`` in ``dtype``; returns what ran (shapes, row counts, GEMMs, seconds).

    It runs inside a real step, on memory the KV cache left free: running out of it (a long
    ``max_model_len`` makes the largest row block ``max_rows x in_features``) stops the warm-up with a
    warning and ``"stopped"`` in the report, never the step; the kernels it did not reach load at
    their first use, as without it."""
    t0 = time.perf_counter()
    shapes, grid = linear_shapes(module), row_grid(max_rows)
    config = getattr(module, "config", None)
    heads = getattr(config, "heads", None)
    attentions = attention_shapes(heads, config.width // heads, max_rows) if heads else []
    gemms, stopped = 0, None
    try:
        with torch.inference_mode():
            for fan_in, fan_out, bias in shapes:
                weight = torch.zeros(fan_out, fan_in, dtype=dtype, device=device)
                b = torch.zeros(fan_out, dtype=dtype, device=device) if bias else None
                rows = torch.zeros(max_rows, fan_in, dtype=dtype, device=device)
                for m in grid:
                    F.linear(rows[:m], weight, b)
                    gemms += 1
                del weight, b, rows
            for records, queries, keys in attentions:
                matmul_attention(*_attention_inputs(records, queries, keys, heads, config.width // heads, dtype, device))
                gemms += 2
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as exc:
        stopped = f"out of memory after {gemms} GEMMs ({str(exc).splitlines()[0][:200]})"
    report = {"shapes": len(shapes), "row_counts": len(grid), "max_rows": max_rows, "attentions": len(attentions),
              "gemms": gemms, "seconds": round(time.perf_counter() - t0, 3)}
    if stopped is not None:
        report["stopped"] = stopped
        log.warning("clef GEMM warm-up stopped: %s; the head's kernels it did not reach load at their first use "
                    "(--gemm-warmup off skips it)", stopped)
        return report
    log.info("clef GEMM warm-up: the head's %d linear shapes at %d row counts up to %d and %d matmul attentions "
             "(%d GEMMs) in %.2f s", report["shapes"], report["row_counts"], max_rows, report["attentions"],
             report["gemms"], report["seconds"])
    return report


class GridRows(TorchFunctionMode):
    """Inside it (``with grid:``), ``F.linear`` runs at a row count of :func:`row_grid` (``max_rows``): its
    input's rows (all dimensions but the last) padded up to the next grid count, the output cut back to the
    real rows. Counts on the grid, above ``max_rows``, and GEMMs inside a CUDA graph capture run as they are.

    The padding rows are not written (each output row depends only on its own input row) and cost at most
    ``ROW_RATIO - 1`` of the GEMM and one copy of its input; a padded copy that does not fit in memory runs
    the GEMM unpadded instead. Counters: :attr:`gemms` seen, :attr:`padded` of them, :attr:`extra_rows` they
    added, :attr:`unpadded` for want of memory."""

    def __init__(self, max_rows: int, ratio: float = ROW_RATIO):
        super().__init__()
        self.grid = row_grid(max_rows, ratio)
        self.gemms = self.padded = self.extra_rows = self.unpadded = 0

    def target(self, rows: int) -> int:
        """The grid count ``rows`` runs at: the smallest one at least ``rows``, or ``rows`` above the grid."""
        i = bisect.bisect_left(self.grid, rows)
        return self.grid[i] if i < len(self.grid) else rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            return self._linear(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.gemms += 1
        fan_in = x.shape[-1]
        rows = x.numel() // fan_in if fan_in else 0
        target = self.target(rows) if rows else rows
        if target == rows or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return F.linear(x, weight, bias)
        try:
            padded = x.new_empty(target, fan_in)
        except torch.OutOfMemoryError:     # the memory the KV cache left is short: this GEMM as it is
            self.unpadded += 1
            return F.linear(x, weight, bias)
        padded[:rows].copy_(x.reshape(rows, fan_in))
        self.padded += 1
        self.extra_rows += target - rows
        return F.linear(padded, weight, bias)[:rows].view(*x.shape[:-1], weight.shape[0])

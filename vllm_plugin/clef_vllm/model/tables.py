"""Token tables the head reads: the lm_head rows of option tokens (and the embedding on load).

Repacked checkpoints store ``embed_tokens`` and ``lm_head`` in ``clef_head/tables_int8.safetensors``
as int8 with one float32 scale per row (``row ≈ q · scale``). The lm_head table stays int8 in
memory; only the rows a request needs are gathered and dequantized.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

TABLE_NAMES = ("embed_tokens", "lm_head")


def table_keys(name: str) -> tuple[str, str]:
    """Tensor names of one int8 table inside ``tables_int8.safetensors``: (int8 rows, float32 scales)."""
    return f"{name}.weight", f"{name}.scale"


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``scale = max|row| / 127`` (1 for all-zero rows), ``q = round(row / scale)``."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def scale_rows(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 ``rows`` (``[..., H]``) times their ``scale`` (``[...]``) in float32, rounded to ``dtype``: the one
    arithmetic of every int8 table, so rows gathered first and a table dequantized whole agree bit for bit."""
    return (rows.float() * scale.unsqueeze(-1)).to(dtype)


class LexicalTable(nn.Module):
    """A [V, H] table from which rows are gathered in a given dtype."""

    num_rows: int
    width: int

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class DenseTable(LexicalTable):
    """A table kept in its stored 16-bit (or fp32) dtype."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.num_rows, self.width = weight.shape

    def rows(self, ids, dtype):
        return self.weight[ids].to(dtype)


class Int8RowTable(LexicalTable):
    """int8 rows + one float32 scale per row; rows are dequantized on gather."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scale", scale.float().reshape(-1), persistent=False)
        self.num_rows, self.width = weight.shape

    def rows(self, ids, dtype):
        return scale_rows(self.weight[ids], self.scale[ids], dtype)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The whole table in ``dtype`` (the reference backend's embedding)."""
        out = torch.empty(self.weight.shape, dtype=dtype, device=self.weight.device)
        step = 8192
        for start in range(0, self.num_rows, step):  # bounded fp32 temporaries
            sl = slice(start, start + step)
            out[sl] = scale_rows(self.weight[sl], self.scale[sl], dtype)
        return out


class TableError(ValueError):
    """The int8 table file is malformed."""


def check_int8_table(name: str, weight: torch.Tensor, scale: torch.Tensor, source: str | Path,
                     shape: tuple[int, int] | None = None) -> None:
    """Refuse a table with the wrong dtype or shape, or with non-finite / non-positive scales."""
    wk, sk = table_keys(name)
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise TableError(f"{source}: {wk} must be a 2-D int8 tensor, got {weight.dtype} {tuple(weight.shape)}")
    if shape is not None and tuple(weight.shape) != tuple(shape):
        raise TableError(f"{source}: {wk} has shape {tuple(weight.shape)}, expected {tuple(shape)}")
    if scale.numel() != weight.shape[0] or not scale.is_floating_point():
        raise TableError(f"{source}: {sk} must hold one float scale per row ({weight.shape[0]}), "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise TableError(f"{source}: {sk} has non-finite or non-positive scales")


def load_int8_tables(path: str | Path, device="cpu", names=TABLE_NAMES) -> dict[str, Int8RowTable]:
    """Read and check ``tables_int8.safetensors``; returns the requested tables."""
    from safetensors import safe_open

    out = {}
    try:
        handle = safe_open(str(path), framework="pt", device=str(device))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types on corrupt or truncated files
        raise TableError(f"{path}: unreadable safetensors file ({exc})") from None
    with handle as f:
        keys = set(f.keys())
        for name in names:
            wk, sk = table_keys(name)
            missing = [k for k in (wk, sk) if k not in keys]
            if missing:
                raise TableError(f"{path}: missing tensor(s) {missing}")
            weight, scale = f.get_tensor(wk), f.get_tensor(sk)
            check_int8_table(name, weight, scale, path)
            out[name] = Int8RowTable(weight, scale)
    return out

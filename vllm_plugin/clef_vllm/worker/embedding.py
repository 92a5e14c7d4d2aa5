"""The token embedding of a repacked checkpoint, kept int8 on the GPU.

A repacked checkpoint stores the embedding in ``clef_head/tables_int8.safetensors`` as int8 rows with
one float32 scale per row (:mod:`clef_vllm.model.tables`). :class:`Int8RowEmbedding` holds exactly that in
the worker, 1 byte a weight and 4 bytes a row instead of vLLM's 2 bytes a weight (0.95 GiB less for
Qwen3.5-9B's 248,320 x 4,096 table), and gathers the rows a step's tokens need, scaling each one in
float32 and rounding it to the model's dtype with :func:`clef_vllm.model.tables.scale_rows`, the arithmetic of
dequantizing the whole table once (:meth:`clef_vllm.model.tables.Int8RowTable.dequantize`): the hidden states are
bit for bit the same.

Tensor parallelism follows vLLM's ``VocabParallelEmbedding``: each rank holds the rows of its slice of
the (padded) vocabulary, ids outside it read zeros and the ranks' outputs are summed.
"""

from __future__ import annotations

import torch
from torch import nn

from clef_vllm.model.tables import Int8RowTable, scale_rows

#: vLLM pads the vocabulary to a multiple of this before splitting it between tensor-parallel ranks.
VOCAB_PADDING = 64


def _tp() -> tuple[int, int]:
    """(rank, world size) of tensor parallelism; (0, 1) outside a vLLM worker."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError):        # no process group: one rank
        return 0, 1


def vocab_slice(num_rows: int, rank: int, world: int, padding: int = VOCAB_PADDING) -> tuple[int, int]:
    """The ``[start, end)`` rows of the vocabulary that tensor-parallel ``rank`` of ``world`` holds (vLLM's split
    of the padded vocabulary; the last ranks' slices end at ``num_rows``)."""
    padded = -(-num_rows // padding) * padding
    per_rank = padded // world
    start = min(rank * per_rank, num_rows)
    return start, min(start + per_rank, num_rows)


class Int8RowEmbedding(nn.Module):
    """int8 embedding rows + a float32 scale per row, this rank's slice of the vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.tp_rank, self.tp_size = _tp()
        self.start, self.end = vocab_slice(num_embeddings, self.tp_rank, self.tp_size)
        rows = self.end - self.start
        self.register_buffer("weight", torch.zeros(rows, embedding_dim, dtype=torch.int8, device=device),
                             persistent=False)
        self.register_buffer("scale", torch.ones(rows, dtype=torch.float32, device=device), persistent=False)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()

    def load(self, table: Int8RowTable) -> None:
        """Copy this rank's rows of a whole table (``table.num_rows == num_embeddings``)."""
        if (table.num_rows, table.width) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"embedding table is {table.num_rows}x{table.width}, expected "
                             f"{self.num_embeddings}x{self.embedding_dim}")
        self.weight.copy_(table.weight[self.start:self.end])
        self.scale.copy_(table.scale[self.start:self.end])

    def fill_dummy(self) -> None:
        """Random rows (``--load-format dummy``/``clef-dummy``: a benchmark's activations look like a real
        model's, not all zeros): int8 uniform in [-127, 127] from torch's generator (vLLM's dummy loader seeds
        it), scales giving values of about ±0.02."""
        self.weight.random_(-127, 128)
        self.scale.fill_(0.02 / 127)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.long()
        if self.tp_size > 1:
            outside = (ids < self.start) | (ids >= self.end)
            ids = torch.where(outside, torch.zeros_like(ids), ids - self.start)
        out = scale_rows(self.weight[ids], self.scale[ids], self.dtype)
        if self.tp_size > 1:
            from vllm.distributed import tensor_model_parallel_all_reduce

            out.masked_fill_(outside.unsqueeze(-1), 0)
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, int8 rows "
                f"{self.start}-{self.end} with a float32 scale each, tp_size={self.tp_size}")

"""GPU check: the int8 row-scaled embedding gathers, on the GPU, bit for bit the rows of its table dequantized whole.

    python3 tests/gpu/int8_embedding.py [--ids 4096]

Builds the tiny checkpoint in the repacked layout, loads its ``embed_tokens`` table into
:class:`~clef_vllm.worker.embedding.Int8RowEmbedding` on the GPU and compares the rows of random ids with
``Int8RowTable.dequantize`` (the whole table in BF16, the path the worker took before) indexed the same way.
Exits 1 when any element differs. Needs torch with CUDA only (no vLLM engine).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", type=int, default=4096, help="random token ids to compare (default 4096)")
    args = ap.parse_args()
    from clef_vllm.model.checkpoint import locate_checkpoint
    from clef_vllm.model.tables import load_int8_tables
    from clef_vllm.model.tiny import build_tiny_checkpoint
    from clef_vllm.worker.embedding import Int8RowEmbedding

    folder = Path(tempfile.mkdtemp()) / "tiny"
    build_tiny_checkpoint(folder, layout="repacked")
    table = load_int8_tables(locate_checkpoint(folder).tables_file)["embed_tokens"]
    embedding = Int8RowEmbedding(table.num_rows, table.width, torch.bfloat16, device="cuda")
    embedding.load(table)
    ids = torch.randint(0, table.num_rows, (args.ids,), device="cuda")
    want = table.dequantize(torch.bfloat16).cuda()[ids]
    same = torch.equal(embedding(ids), want)
    print(f"int8 embedding on {torch.cuda.get_device_name()}: {args.ids} rows bit-identical to the dequantized "
          f"table: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

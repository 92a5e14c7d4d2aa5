"""Tensor ops one vLLM step spends on head inputs + the head, for 1, 8 and 64 finishing records.

Inside vLLM every such op is a kernel launch on the step's critical path. CPU only (small head
dims; the op count does not depend on the dims):

    python bench/head_ops.py
"""

from __future__ import annotations

import json
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from clef_vllm.features import RecordAccumulator, accumulate, decide_records
from clef_vllm.head import HeadConfig, JointSchemaHead
from clef_vllm.tables import Int8RowTable
from clef_vllm.worker.pooler import synthetic_spec

VIEWS = {"aten::view", "aten::transpose", "aten::slice", "aten::select", "aten::unsqueeze", "aten::reshape",
         "aten::chunk", "aten::lift_fresh", "aten::detach_", "aten::t", "aten::expand", "aten::split",
         "aten::squeeze", "aten::alias", "aten::as_strided", "aten::empty", "aten::permute", "aten::_unsafe_view",
         "aten::split_with_sizes", "aten::narrow", "aten::detach", "aten::dropout", "aten::empty_strided"}


def count(head, table, lengths: list[int]) -> dict:
    """Non-view tensor ops of one step in which records of these prompt lengths all finish."""
    hidden = torch.randn(sum(lengths), head.config.hidden_size)
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        accs = [RecordAccumulator(synthetic_spec(n)) for n in lengths]
        accumulate(head, hidden, [(a, o, n, 0) for a, o, n in zip(accs, offsets, lengths)])
        decide_records(head, table, accs)
    top = [e for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    ops = Counter(e.name for e in top if e.name not in VIEWS)
    return {"records": len(lengths), "tensor_ops": sum(ops.values()), "top": ops.most_common(6)}


def main() -> None:
    torch.manual_seed(0)
    head = JointSchemaHead(HeadConfig(hidden_size=128, width=64, routing_layers=2, layers=4, heads=4,
                                      feedforward=128)).eval()
    table = Int8RowTable(torch.randint(-127, 127, (1000, 128), dtype=torch.int8), torch.rand(1000) * 0.01)
    for batch in (1, 8, 64):
        print(json.dumps(count(head, table, [300 + 7 * i for i in range(batch)])))   # lengths differ: padded


if __name__ == "__main__":
    main()

"""The joint head's per-step cost: tensor ops (CPU) and, with ``--time``, milliseconds (GPU).

Inside vLLM every op of the head inputs + head is a kernel launch on the step's critical path.
The op count (small head dims; it does not depend on the dims) for 1, 8 and 64 finishing records:

    python -m clef_vllm.bench.head_ops

The test suite checks the same count (tests/test_head.py). ``--time`` instead times one step's
head work at the release's dims (bf16, a 248,320-row int8 lm_head table) for a few batch shapes:

    python -m clef_vllm.bench.head_ops --time --device cuda
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from clef_vllm.model.features import RecordAccumulator, accumulate, decide_records
from clef_vllm.model.features import synthetic_spec
from clef_vllm.model.head import HeadConfig, JointSchemaHead
from clef_vllm.model.tables import Int8RowTable

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


def time_head(device: str = "cuda", shapes=((1, 300), (8, 300), (64, 300), (1, 4096), (1, 16384)),
              repeats: int = 10) -> dict:
    """Milliseconds of one step's head inputs + head for ``(records, tokens each)`` shapes, release dims, bf16."""
    from clef_vllm.model.release import RELEASE_HEAD_CONFIG

    dev = torch.device(device)
    cfg = RELEASE_HEAD_CONFIG
    head = JointSchemaHead(cfg).to(dev, torch.bfloat16).eval()
    vocab = 248320
    table = Int8RowTable(torch.randint(-127, 127, (vocab, cfg.hidden_size), dtype=torch.int8, device=dev),
                         torch.rand(vocab, device=dev) * 0.01)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {}
    with torch.inference_mode():
        for batch, length in shapes:
            spec = synthetic_spec(length)
            hidden = torch.randn(batch * length, cfg.hidden_size, device=dev, dtype=torch.bfloat16)

            def once(spec=spec, hidden=hidden, batch=batch, length=length):
                accs = [RecordAccumulator(spec) for _ in range(batch)]
                accumulate(head, hidden, [(a, i * length, length, 0) for i, a in enumerate(accs)])
                return decide_records(head, table, accs)

            for _ in range(3):
                once()
            sync()
            t = time.perf_counter()
            for _ in range(repeats):
                once()
            sync()
            out[f"b{batch}_L{length}_ms"] = round((time.perf_counter() - t) / repeats * 1000, 3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time", action="store_true", help="time the head at the release's dims instead of counting ops")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="with --time")
    a = ap.parse_args(argv)
    if a.time:
        print(json.dumps({"mode": "head", "device": a.device, **time_head(a.device)}))
        return
    torch.manual_seed(0)
    head = JointSchemaHead(HeadConfig(hidden_size=128, width=64, routing_layers=2, layers=4, heads=4,
                                      feedforward=128)).eval()
    table = Int8RowTable(torch.randint(-127, 127, (1000, 128), dtype=torch.int8), torch.rand(1000) * 0.01)
    for batch in (1, 8, 64):
        print(json.dumps(count(head, table, [300 + 7 * i for i in range(batch)])))   # lengths differ: padded


if __name__ == "__main__":
    main()

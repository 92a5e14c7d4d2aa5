"""The joint head's decision over one record's memory, SDPA's fused attention against the matmul route
(``clef_vllm.model.head.attention_route``), GPU time per decision replayed from a CUDA graph as the head graphs
run it. Needs a CUDA GPU and torch only (no vLLM).

    python bench/head_attention.py [-o head_attention.json]

Per memory length (a single record padded to that many rows, 10 % of them padding; 3 fields, 8
options in a (4, 16) schema bucket, the release head's dimensions in bf16): the median GPU ms per
replay of each variant (:data:`VARIANTS`), and the largest |Δ| of each one's logits from the first's.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from clef_vllm.model import head as head_module
from clef_vllm.model.head import DecisionBatch, FieldLayout, JointSchemaHead
from clef_vllm.model.release import RELEASE_HEAD_CONFIG

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 24576, 32768)
#: (name, route, cuDNN attention on): SDPA as the server runs it (vLLM turns PyTorch's cuDNN attention off at
#: import, so SDPA takes its memory-efficient kernel), SDPA with cuDNN (PyTorch's own default), two matmuls.
VARIANTS = (("efficient", "fused", False), ("cudnn", "fused", True), ("matmul", "matmul", False))


def batch_for(length: int, config, device, dtype, gen) -> DecisionBatch:
    h, d = config.hidden_size, config.width
    types, options = [0, 1, 2], [2, 3, 3]
    layout = FieldLayout.from_records([(types, options)]).to(device)
    padding = torch.zeros(1, length, dtype=torch.bool, device=device)
    padding[:, length - length // 10:] = True

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return DecisionBatch(memory=rand(1, length, d), memory_padding=padding, last_state=rand(1, h),
                         question_state=rand(len(types), h), option_context=rand(sum(options), h),
                         option_lexical=rand(sum(options), h), layout=layout)


def time_graph(fn, replays: int = 50) -> tuple[float, torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out.clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default="head_attention.json")
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    head = JointSchemaHead(RELEASE_HEAD_CONFIG).to(device, dtype).eval()
    gen = torch.Generator(device=device).manual_seed(1)
    auto = head_module.attention_route
    rows = []
    with torch.inference_mode():
        for length in LENGTHS:
            batch = batch_for(length, RELEASE_HEAD_CONFIG, device, dtype, gen)
            result = {"memory_rows": length}
            for name, route, cudnn in VARIANTS:
                head_module.attention_route = lambda *shape, r=route: r if shape[3] > 64 else "fused"
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
                try:
                    ms, logits = time_graph(lambda b=batch: head.decide(b))
                finally:
                    head_module.attention_route = auto
                    torch.backends.cuda.enable_cudnn_sdp(False)
                result[f"{name}_ms"] = round(ms, 4)
                result[f"{name}_logits"] = logits.float()
            base = result.pop("efficient_logits")
            for name, *_ in VARIANTS[1:]:
                result[f"max_abs_diff_{name}"] = float((result.pop(f"{name}_logits") - base).abs().max())
            shape = (1, RELEASE_HEAD_CONFIG.heads, 16, length, RELEASE_HEAD_CONFIG.width // RELEASE_HEAD_CONFIG.heads)
            result["auto_route_16_queries"] = auto(*shape)
            rows.append(result)
            print(json.dumps(result), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "config": RELEASE_HEAD_CONFIG.to_dict(), "results": rows}
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

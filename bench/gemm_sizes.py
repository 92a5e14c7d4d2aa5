"""GPU time of the 9B backbone's linear layers per padded token count: which sizes are cheap to pad to.

Why: in a profile of the default server, one 400-token decision spent 9.4 ms of GPU time in GEMMs
when the step graph padded it to 448 tokens, against 8.0 ms for raw vLLM at its real 409 tokens
(bench/results/README.md): cuBLAS picks its kernel per shape, and the time is not proportional to
the rows. The step graphs pad every single-sequence step to a bucket (``DEFAULT_BUCKETS``); this
sweep times the backbone's GEMMs (every linear layer of the config, times its layer count) at each
token count, so the buckets can sit where the kernels are cheap.

    python3 bench/gemm_sizes.py --config CKPT/config.json --tokens 256:1024:16 --out $OUT/gemm_sizes.json
    python3 bench/gemm_sizes.py ... --fp8        # vLLM's cutlass FP8 (per-tensor scales), as online FP8 runs

Each shape is timed with CUDA events over ``--repeats`` calls after a warm-up, median of 5 rounds.
Prints one line per token count (ms for the whole backbone's GEMMs, and per token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def linear_shapes(config: dict) -> list[tuple[str, int, int, int]]:
    """``(name, out_features, in_features, layers)`` of the backbone's linear layers (Qwen3.5: GDN and
    full-attention layers, a gated MLP in every layer); the LM head is not part of a Clef step."""
    t = config.get("text_config", config)
    hidden, inter, layers = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
    full = layers // t.get("full_attention_interval", 4)
    gdn = layers - full
    key, value = t["linear_num_key_heads"] * t["linear_key_head_dim"], t["linear_num_value_heads"] * t["linear_value_head_dim"]
    heads, kv, head_dim = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    return [("mlp.gate_up", 2 * inter, hidden, layers), ("mlp.down", hidden, inter, layers),
            ("gdn.in_proj_qkvz", 2 * key + 2 * value, hidden, gdn), ("gdn.in_proj_ba", 2 * t["linear_num_value_heads"], hidden, gdn),
            ("gdn.out_proj", hidden, value, gdn), ("attn.qkv", 2 * heads * head_dim + 2 * kv * head_dim, hidden, full),
            ("attn.o_proj", hidden, heads * head_dim, full)]


def parse_tokens(spec: str) -> list[int]:
    """``LO:HI:STEP`` (inclusive) or a comma list."""
    if ":" in spec:
        lo, hi, step = (int(x) for x in spec.split(":"))
        return list(range(lo, hi + 1, step))
    return [int(x) for x in spec.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a checkpoint's config.json (bench/make_ckpt.py 9b)")
    ap.add_argument("--tokens", default="256:1024:16", help="LO:HI:STEP or a comma list (default 256:1024:16)")
    ap.add_argument("--fp8", action="store_true", help="vLLM's cutlass FP8 GEMM instead of BF16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)

    import torch

    config = json.loads(Path(args.config).read_text())
    shapes = linear_shapes(config)
    dev = torch.device("cuda")
    tokens = parse_tokens(args.tokens)
    weights = {name: torch.randn(out, inp, device=dev, dtype=torch.bfloat16) * 0.02 for name, out, inp, _ in shapes}
    x_max = torch.randn(max(tokens), max(inp for _, _, inp, _ in shapes), device=dev, dtype=torch.bfloat16)
    if args.fp8:
        from vllm import _custom_ops as ops

        fp8 = torch.float8_e4m3fn
        weights = {name: w.to(fp8).t() for name, w in weights.items()}      # column-major, as vLLM keeps it
        one = torch.ones(1, device=dev, dtype=torch.float32)
        x_max = x_max.to(fp8)

        def gemm(x, w):
            return ops.cutlass_scaled_mm(x, w, out_dtype=torch.bfloat16, scale_a=one, scale_b=one)
    else:
        def gemm(x, w):
            return torch.nn.functional.linear(x, w)

    def time_shape(m: int, name: str, inp: int) -> float:
        x = x_max[:m, :inp].contiguous()
        w = weights[name]
        for _ in range(3):
            gemm(x, w)
        rounds = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeats):
                gemm(x, w)
            end.record()
            end.synchronize()
            rounds.append(start.elapsed_time(end) / args.repeats)
        return statistics.median(rounds)

    rows = []
    for m in tokens:
        per = {name: time_shape(m, name, inp) for name, _, inp, _ in shapes}
        total = sum(per[name] * count for name, _, _, count in shapes)
        rows.append({"tokens": m, "backbone_gemm_ms": round(total, 4), "us_per_token": round(1000 * total / m, 3),
                     "per_layer_ms": {k: round(v, 5) for k, v in per.items()}})
        print(f"{m:6d}  {total:8.3f} ms  {1000 * total / m:7.2f} us/token", flush=True)
    result = {"config": args.config, "dtype": "fp8 (cutlass, per-tensor)" if args.fp8 else "bf16",
              "gpu": torch.cuda.get_device_name(), "shapes": [dict(zip(("name", "out", "in", "layers"), s)) for s in shapes],
              "repeats": args.repeats, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

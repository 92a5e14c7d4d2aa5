"""What the GDN prefill's autotuned Triton kernels cost at each of their configs, at the shapes a server meets.

Why: vLLM 0.28 autotunes the flash-linear-attention kernels of the GDN prefill (kkt, solve_tril's merge,
recompute_w_u, the state recurrence ``chunk_gated_delta_rule_fwd_h``, ``chunk_fwd_o``, the cumsum) once, at
their first call, and their autotune keys leave out the token and sequence counts. Its Qwen3.5 layers
make that first call a warm-up of one 64-token sequence, so every later step, 16,000 tokens of 41 sequences
included, runs the config that was fastest at 64 tokens, where launch time hides the kernels' own time.
Profiled at c=64 (9B-shaped, BF16), the state recurrence took 13.4-14.0 ms of a 16,000-token step in
three processes and 9.8 ms in a fourth: the configs differ from process to process.

This runs the GDN chunk op (Qwen3.5-9B's GDN dimensions: 16 key heads, 32 value heads, 128 x 128) the way
vLLM does (a 64-token warm-up first, then the real shapes), records each autotuned kernel's call at each
shape, and times every config of it there (Triton's own benchmark of the autotuner, fewer repetitions).
Per shape and kernel it reports the config the warm-up chose, the best one, and their times; per shape,
what the op's tuned kernels would save per step over 24 GDN layers.

    PYTHONPATH=/root/site:$PWD/vllm_plugin python3 bench/gdn_configs.py --out $OUT/gdn_configs.json

(``h200_gdn_configs.json`` was made by this script with its own copy of the kernel lookup, before that lookup
moved to ``clef_vllm.worker.fast.gdn_tuning.autotuned_kernels``.)
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

#: (sequences, tokens each): vLLM's warm-up, one short decision (its graph bucket), c=4 / c=16 / c=64 steps
#: of short decisions, one long state.
SHAPES = ((1, 64), (1, 416), (4, 400), (16, 400), (41, 391), (1, 4096), (1, 16384))
GDN_LAYERS = 24


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep-ms", type=float, default=20.0, help="benchmark time per config (Triton do_bench rep)")
    args = ap.parse_args()

    import torch
    import triton.testing
    from vllm.third_party.flash_linear_attention.ops import chunk as chunk_ops
    from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices, prepare_chunk_offsets

    from clef_vllm.worker.fast.gdn_tuning import autotuned_kernels

    tuners = autotuned_kernels()
    calls: dict[str, tuple] = {}
    for name, tuner in tuners.items():
        original = tuner.run

        def recording(*a, _name=name, _run=original, **kw):
            calls[_name] = (a, kw)
            return _run(*a, **kw)

        tuner.run = recording
        tuner.__dict__["do_bench"] = functools.partial(triton.testing.do_bench, warmup=5, rep=args.rep_ms,
                                                       quantiles=(0.5, 0.2, 0.8))

    dev = "cuda"

    def op(n: int, length: int):
        torch.manual_seed(0)
        t = n * length
        norm = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
        q = norm(torch.randn(1, t, 16, 128, device=dev, dtype=torch.float32)).to(torch.bfloat16)
        k = norm(torch.randn(1, t, 16, 128, device=dev, dtype=torch.float32)).to(torch.bfloat16)
        v = torch.randn(1, t, 32, 128, device=dev, dtype=torch.bfloat16)
        g = torch.nn.functional.logsigmoid(torch.randn(1, t, 32, device=dev, dtype=torch.float32))
        beta = torch.rand(1, t, 32, device=dev, dtype=torch.bfloat16)
        h0 = torch.zeros(n, 32, 128, 128, device=dev, dtype=torch.float32)
        cu = torch.arange(0, t + 1, length, device=dev, dtype=torch.int32)
        ci, co = prepare_chunk_indices(cu, 64), prepare_chunk_offsets(cu, 64)
        return lambda: chunk_ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                        cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co,
                                                        use_qk_l2norm_in_kernel=False)

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": GDN_LAYERS, "shapes": []}
    t0 = time.perf_counter()
    op(1, 64)()                                   # vLLM's warm-up: every kernel autotuned at 64 tokens
    torch.cuda.synchronize()
    out["warmup_autotune_s"] = round(time.perf_counter() - t0, 2)
    chosen = {name: tuner.best_config for name, tuner in tuners.items() if name in calls}
    out["warmup_chose"] = {name: str(cfg) for name, cfg in chosen.items()}
    for n, length in SHAPES:
        calls.clear()
        call = op(n, length)
        call()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        for _ in range(10):
            call()
        e1.record()
        torch.cuda.synchronize()
        row = {"sequences": n, "tokens": n * length, "op_ms": round(e0.elapsed_time(e1) / 10, 4), "kernels": {}}
        saved = 0.0
        for name, (a, kw) in calls.items():
            tuner = tuners[name]
            times = {}
            tuner.nargs = dict(zip(tuner.arg_names, a))     # what the autotuner's run() sets before benchmarking
            for cfg in tuner.prune_configs(kw):
                try:
                    times[str(cfg)] = float(tuner._bench(*a, config=cfg, **kw)[0])
                except Exception as exc:  # noqa: BLE001  (a config that cannot run at this shape is reported)
                    times[str(cfg)] = f"{type(exc).__name__}"
            ok = {c: t for c, t in times.items() if isinstance(t, float) and t == t and t != float("inf")}
            best = min(ok, key=ok.get)
            mine = ok.get(str(chosen.get(name)))
            row["kernels"][name] = {"warmup_config": str(chosen.get(name)), "warmup_ms": mine, "best_config": best,
                                    "best_ms": ok[best], "configs_ms": times}
            if mine is not None:
                saved += mine - ok[best]
        row["saved_per_call_ms"] = round(saved, 4)
        row["saved_per_step_ms"] = round(saved * GDN_LAYERS, 3)
        out["shapes"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}
                         | {"kernels": {k: (v["warmup_ms"], v["best_ms"], v["best_config"]) for k, v in row["kernels"].items()}}),
              flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

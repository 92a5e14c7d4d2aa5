"""How long the GPU waits for a CUDA graph's launch, and whether launching it in pieces helps.

Why: profiled at c=1, the FP8 server's backbone graph (1,097 kernels) began its first kernel only
when its 1.6-1.8 ms launch call ended, every step (bench/results/h200_9b_fp8_default_server_timeline_c1.txt),
while BF16's 1,129-kernel graphs mostly began 0.1 ms into the call. The profiler (CUPTI) records
every kernel of a graph and may itself slow the launch; this probe measures without it, then with
it, on a synthetic graph shaped like one short decision's backbone: ``--layers`` layers, each a few
matrix multiplies of ``--rows`` rows and a tail of small element-wise kernels (34 kernels a
layer, 1,088 in all at the defaults).

The same work is captured as 1, 2, 4, 8 ... graphs (consecutive layers, one memory pool) and
replayed in order. For each split it reports medians over ``--repeats`` runs:

- ``host_ms``: the replay calls' own host time;
- ``gpu_ms``: the GPU time of the graphs when their launch is not waited for (a ~``--sleep-ms`` GPU
  sleep is queued first, so the whole launch is submitted before the GPU reaches it);
- ``idle_start_ms``: the same span with the GPU idle when the first replay begins (as at c=1), from
  an event recorded just before it to one after the last graph; ``stall_ms`` = ``idle_start_ms -
  gpu_ms`` is what the launch costs the GPU;
- ``wall_ms``: host time from the first replay call to ``synchronize()`` returning, GPU idle before;
- ``profiled_host_ms``: the replay calls' host time under ``torch.profiler`` recording CUDA activity.

Measured (H200, torch 2.11 + CUDA 13.0; bench/results/h200_graph_launch_probe.json): one graph of 1,088
kernels launches in 0.055 ms of host time and the GPU waits 0.054 ms for it; under the profiler the same
call takes 1.06 ms. Pieces only add launch calls (2-32 graphs: 0.39-1.05 ms of host time, 0.08-0.22 ms of
wait). So the late first kernel in the profiled server steps is the profiler's, and a step graph stays
whole.

    python3 bench/graph_launch_probe.py --out $OUT/graph_launch_probe.json
    python3 bench/graph_launch_probe.py --pieces 1,2,4,8,32 --layers 32 --rows 448
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def split_points(layers: int, pieces: int) -> list[tuple[int, int]]:
    """``[start, end)`` layer ranges of ``pieces`` consecutive, near-equal parts (the first ones longer)."""
    if not 1 <= pieces <= layers:
        raise ValueError(f"pieces must be between 1 and the layer count ({layers}), not {pieces}")
    base, extra = divmod(layers, pieces)
    out, start = [], 0
    for i in range(pieces):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pieces", default="1,2,4,8,32", help="comma list of graph counts to compare")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=448, help="rows of the activations (a padded short decision)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--small-ops", type=int, default=26, help="small element-wise kernels per layer")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--sleep-ms", type=float, default=20.0, help="GPU sleep queued before the launch-free timing")
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)

    import torch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    h = args.hidden
    weights = [(torch.randn(h, 3 * h, device=dev, dtype=torch.bfloat16) * 0.01,
                torch.randn(3 * h, h, device=dev, dtype=torch.bfloat16) * 0.01) for _ in range(args.layers)]
    x0 = torch.randn(args.rows, h, device=dev, dtype=torch.bfloat16)
    small = torch.zeros(args.rows, 32, device=dev, dtype=torch.float32)

    def layer(i: int, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = weights[i]
        y = torch.nn.functional.silu(x @ w1) @ w2
        s = small
        for _ in range(args.small_ops):          # one kernel each, like a graph's feeds, masks and copies
            s = s.add(0.25)
        return (x + y * 0.01) + s[:, :1].to(x.dtype) * 0.0

    # cycles per ms of the GPU sleep, from a short calibration
    probe_cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(probe_cycles)
    end.record()
    end.synchronize()
    sleep_cycles = int(probe_cycles * args.sleep_ms / start.elapsed_time(end))

    def replay_all(graphs: list) -> float:
        t0 = time.perf_counter()
        for g in graphs:
            g.replay()
        return (time.perf_counter() - t0) * 1000

    rows, kept = [], []
    for pieces in [int(p) for p in args.pieces.split(",")]:
        pool = torch.cuda.graph_pool_handle()         # one per split (a pool outlives its graphs only while used)
        ranges = split_points(args.layers, pieces)
        static_in = x0.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                 # warm-up outside the capture
            x = static_in
            for i in range(args.layers):
                x = layer(i, x)
        torch.cuda.current_stream().wait_stream(side)
        graphs, x = [], static_in
        for lo, hi in ranges:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                for i in range(lo, hi):
                    x = layer(i, x)
            graphs.append(g)
        out = x
        torch.cuda.synchronize()

        for _ in range(3):
            replay_all(graphs)
        torch.cuda.synchronize()
        host, gpu, idle, wall = [], [], [], []
        for _ in range(args.repeats):
            # launch-free GPU time: the launch is submitted while the GPU sleeps
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(sleep_cycles)
            e0.record()
            replay_all(graphs)
            e1.record()
            e1.synchronize()
            gpu.append(e0.elapsed_time(e1))
            # idle GPU at the first replay, as for one decision at c=1
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            host.append(replay_all(graphs))
            e1.record()
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - t0) * 1000)
            idle.append(e0.elapsed_time(e1))
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        profiled = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.cuda.synchronize()
                profiled.append(replay_all(graphs))
                torch.cuda.synchronize()
        nodes = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA) // 5
        med = statistics.median
        row = {"pieces": pieces, "layers_per_piece": [hi - lo for lo, hi in ranges], "kernels": nodes,
               "host_ms": round(med(host), 3), "gpu_ms": round(med(gpu), 3), "idle_start_ms": round(med(idle), 3),
               "stall_ms": round(med(idle) - med(gpu), 3), "wall_ms": round(med(wall), 3),
               "profiled_host_ms": round(med(profiled), 3),
               "checksum": float(out.float().abs().sum().item())}
        rows.append(row)
        print(f"{pieces:3d} graph(s): host {row['host_ms']:7.3f} ms  gpu {row['gpu_ms']:7.3f}  idle start "
              f"{row['idle_start_ms']:7.3f}  stall {row['stall_ms']:6.3f}  wall {row['wall_ms']:7.3f}  "
              f"profiled host {row['profiled_host_ms']:7.3f}", flush=True)
        kept.append(graphs)
    kernels_per_layer = 3 + args.small_ops + 5          # matmuls and activation, the small chain, the residual
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "layers": args.layers, "rows": args.rows, "hidden": h, "small_ops": args.small_ops,
              "approx_kernels": kernels_per_layer * args.layers, "repeats": args.repeats,
              "sleep_ms": args.sleep_ms, "rows_by_pieces": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast each CPU of this machine runs the host side of a decision step.

A short decision on one GPU is host-bound (docs/latency.md): the engine step takes as long as its
Python and its kernel launches. This pins itself to one CPU at a time and times

- ``python``: a pure-Python loop (interpreter speed on that CPU);
- ``launch``: tiny CUDA kernel launches, synchronised once at the end (the launch path: driver
  calls, doorbell writes; what the host spends per kernel);

and writes one JSON row per CPU, with the machine's topology (SMT siblings, NUMA node, the GPU's
NUMA node), to ``--out``. Usage (on the GPU machine)::

    python3 bench/host_speed.py --out $OUT/host_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def topology() -> dict:
    """SMT siblings and NUMA node of every CPU this process may run on, and the GPUs' NUMA nodes."""
    cpus = sorted(os.sched_getaffinity(0))
    nodes = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        nodes[node.name] = _read(str(node / "cpulist"))
    gpus = {}
    for dev in sorted(Path("/sys/bus/pci/devices").glob("*")):
        if _read(str(dev / "vendor")) == "0x10de" and _read(str(dev / "class")).startswith("0x0302"):
            gpus[dev.name] = _read(str(dev / "numa_node"))
    return {
        "cpus": cpus,
        "siblings": {c: _read(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") for c in cpus},
        "numa_nodes": nodes,
        "gpu_numa_node": gpus,
        "model": next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
                       if ln.startswith("model name")), ""),
    }


def python_loop(n: int = 200_000) -> float:
    t0 = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i & 7
    return (time.perf_counter() - t0) / n * 1e9  # ns per iteration


def launches(torch, x, n: int = 2000) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / n * 1e6  # us of host time per launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    topo = topology()
    x = torch.zeros(16, device="cuda")
    launches(torch, x, 500)  # context and kernel warm-up
    rows = []
    for cpu in topo["cpus"]:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.05)
        py = [python_loop() for _ in range(args.repeats)]
        ln = [launches(torch, x) for _ in range(args.repeats)]
        rows.append({"cpu": cpu, "python_ns": round(statistics.median(py), 2),
                     "launch_us": round(statistics.median(ln), 3)})
        print(json.dumps(rows[-1]), flush=True)
    os.sched_setaffinity(0, set(topo["cpus"]))
    Path(args.out).write_text(json.dumps({"topology": topo, "per_cpu": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

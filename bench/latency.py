"""Where one decision's time goes on the GPU: wall time, GPU kernel time, host time, kernel launches.

Runs the Clef pooling model in-process (``vllm.LLM``, engine core in this process) on a checkpoint
(default: a 9B-shaped config-only folder served with dummy weights) with the server's own engine
settings (``engine_kwargs``), one request at a time, in each MODE (one subprocess per mode):

    graphs     prefill graphs (``--prefill-graph-scope core``: the GDN cores) and head graphs on, state cache off
    eagerhead  the same with the joint head run eagerly (``--head-graphs off``)
    layer      the same as graphs with ``--prefill-graph-scope layer`` (vLLM's packed GDN op in the graph)
    step       the same as graphs with ``--prefill-graph-scope step`` (a whole single-sequence step in one graph;
               the default server)
    nographs   prefill and head graphs off and vLLM's default CUDA-graph sizes ("before")
    capsonly   vLLM's piecewise graphs captured up to the buckets, GDN layers on vLLM's eager path
    cache      prefill graphs on and the state cache on (prefix caching in align mode); also follow-ups
               on one cached 15,872-token state (400 new tokens each): p50 and a profile; and bursts of
               1, 16 and 64 follow-ups on one cached 4,096-token state (330 new tokens each) submitted
               together: wall ms, and a profile of the 64-burst
    cacheblock the same with ``--state-cache-match block`` (hits only at whole KV blocks)
    raw        vLLM ``embed`` pooling of the same ids, vLLM's defaults (no head, no plugin features)

Per mode: single-request p50 for several lengths, 256 x 400-token batch throughput, and a
torch.profiler summary over 5 requests of 400 tokens (GPU kernel ms, CUDA launches, CUDA graph
launches, the ops with the most host and GPU time, where the GPU idles per request, and how much of
that idle time falls inside the worker's GDN cores and the joint head: ``gpu_phases``). Output: one
JSON object per mode (and --out FILE).

``--engine-process`` runs vLLM's engine core in a process of its own, as the server and raw vLLM's
AsyncLLM do (the profiler cannot see into it: no profile, timings only). It separates what the
process split costs from what the engine costs.

``--sweep LO:HI:STEP`` (modes ``graphs`` and ``step``) measures buckets instead: the prefill graphs get a
bucket at every size from LO to HI (the generic buckets outside that range), and one request of exactly
each size runs 10 times (p50 in ``sweep``: one row per size): measured step costs per padded size, for any
checkpoint's kernels (the Hybrid's too), from which a ``--prefill-graph-buckets`` list keeps each length's
cheapest bucket. The checkpoint's weights are made up (``dummy``; ``clef-dummy`` for a quantized checkpoint).

    python3 bench/latency.py [--modes graphs,nographs] [--quantization fp8] [--engine-process] [--ckpt DIR] [--out FILE]
    python3 bench/latency.py --modes step --sweep 256:1024:16 --ckpt DIR --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

MODES = ("graphs", "eagerhead", "layer", "step", "nographs", "capsonly", "cache", "cacheblock", "raw")
CACHE_MODES = {"cache": "unit", "cacheblock": "block"}     # mode -> --state-cache-match
LENGTHS = (100, 400, 1000, 4096)
STATE_TOKENS = 15872      # mode cache: the shared state of the follow-up requests (a 16k prompt with 400 new tokens)
BURST_STATE, BURST_NEW = 4096, 330     # mode cache: bursts of follow-ups on one 4k state


def sweep_sizes(spec: str) -> list[int]:
    """``--sweep LO:HI:STEP`` as token counts (each a valid bucket). ValueError saying what is wrong."""
    from clef_vllm.backends.options import bucket_list

    try:
        lo, hi, step = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"expected LO:HI:STEP, got {spec!r}") from None
    if not 0 < lo <= hi or step <= 0:
        raise ValueError(f"expected 0 < LO <= HI and STEP > 0, got {spec!r}")
    return list(bucket_list(list(range(lo, hi + 1, step))))


def sweep_buckets(sizes: list[int]) -> list[int]:
    """The prefill-graph buckets of a sweep: every swept size, the generic buckets outside the swept range."""
    from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS

    return sorted(set(sizes) | {b for b in DEFAULT_BUCKETS if b < sizes[0] or b > sizes[-1]})


def engine_settings(mode: str, ckpt: Path, quantization: str | None, sweep: list[int] | None = None,
                    nvfp4_kernel: str = "vllm") -> dict:
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.bench.raw_vllm import raw_engine_kwargs
    from clef_vllm.contract import with_settings
    from clef_vllm.worker.dummy_loader import dummy_format_for

    load_format = dummy_format_for(json.loads((Path(ckpt) / "config.json").read_text()))
    common = dict(max_model_len=16384, gpu_memory_utilization=0.85, max_num_seqs=128)
    if mode == "raw":
        kw = raw_engine_kwargs(ckpt, load_format=load_format, max_model_len=16384, gpu_memory_utilization=0.85,
                               max_num_seqs=128, quantization=quantization)
        # vLLM's offline LLM builds its pooling input processors from the tokenizer, so it needs one even
        # for token-id prompts (AsyncLLM, which clef-bench's raw phase uses, does not)
        kw["skip_tokenizer_init"] = False
    else:
        cache = ({"state_cache": True, "state_cache_match": CACHE_MODES[mode]} if mode in CACHE_MODES
                 else {"state_cache": False})    # the other modes measure a step without the cache
        buckets = {"prefill_graph_buckets": sweep_buckets(sweep)} if sweep else {}
        kw = engine_kwargs(ckpt, load_format=load_format, prefill_graphs=mode != "nographs",
                           head_graphs=mode not in ("nographs", "eagerhead"),
                           prefill_graph_scope=mode if mode in ("layer", "step") else
                           None if mode == "nographs" else "core", nvfp4_kernel=nvfp4_kernel, **cache, **buckets,
                           **common)
        if mode == "capsonly":          # vLLM's piecewise graphs up to the buckets, GDN layers eager
            with_settings(kw, prefill_graphs=None)
        if quantization:
            kw["quantization"] = quantization
    kw.pop("disable_log_stats", None)
    return kw


def profiled(request: Callable[[int], float], n: int = 5) -> dict:
    """torch.profiler over ``n`` calls of ``request(i)`` (one request each): per-request wall, GPU kernel
    time, CUDA kernel and graph launches, host time, the ops with the most host and GPU time, and
    where the GPU sat idle in each request's window (``gpu_timeline``: lead / busy / gaps / tail)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from clef_vllm.bench.gpu_timeline import phase_timeline, timeline
    from clef_vllm.util.trace import PHASE_NAMES      # the worker's ranges under CLEF_VLLM_PROFILE_PHASES=1

    mark = "clef_request"           # each request's window; the profiler also shows it as a GPU-side range
    ranges = {mark, *PHASE_NAMES}   # profiler ranges, not kernels
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            with record_function(mark):
                walls.append(request(i))
    raw = prof.events()
    windows = [(e.time_range.start, e.time_range.end) for e in raw if e.name == mark and e.device_type.name == "CPU"]
    gpu = [e for e in raw if e.device_type.name == "CUDA"]
    kernels = [(e.time_range.start, e.time_range.end) for e in gpu if e.name not in ranges]
    phases = {name: [(e.time_range.start, e.time_range.end) for e in gpu if e.name == name] for name in PHASE_NAMES}
    events = [e for e in prof.key_averages() if e.key not in ranges]
    cuda = [e for e in events if e.device_type.name == "CUDA"]
    return {
        "profiled_wall_ms_per_req": round(sum(walls) / n, 1),
        "gpu_kernel_ms_per_req": round(sum(e.self_device_time_total for e in events) / n / 1000, 2),
        "kernel_launches_per_req": round(sum(e.count for e in cuda) / n),
        "graph_launches_per_req": round(sum(e.count for e in events if e.key == "cudaGraphLaunch") / n, 1),
        "host_ms_per_req": round(sum(e.self_cpu_time_total for e in events) / n / 1000, 2),
        "most_host_time": [(e.key[:70], round(e.self_cpu_time_total / n / 1000, 2), e.count // n)
                           for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]],
        "most_gpu_time": [(e.key[:70], round(e.self_device_time_total / n / 1000, 2), e.count // n)
                          for e in sorted(cuda, key=lambda e: -e.self_device_time_total)[:40]],
        "gpu_timeline": timeline(windows, kernels),
        "gpu_phases": phase_timeline(windows, kernels, phases),    # the worker's marked phases
    }


def run_mode(mode: str, ckpt: Path, quantization: str | None, followups_only: bool = False,
             engine_process: bool = False, sweep: list[int] | None = None, nvfp4_kernel: str = "vllm") -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_process else "0"
    if engine_process:      # the worker report below sends a function to the engine core's process
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ["CLEF_VLLM_PROFILE_PHASES"] = "1"     # the worker marks its phases (clef_vllm.util.trace.PHASE_NAMES)
    import torch
    from vllm import LLM, PoolingParams, TokensPrompt

    from clef_vllm import register
    from clef_vllm.backends.vllm_backend import pooling_params
    from clef_vllm.model.features import HeadSpec, synthetic_spec

    register()
    kw = engine_settings(mode, ckpt, quantization, sweep, nvfp4_kernel)
    if isinstance(kw.get("pooler_config"), dict):
        from vllm.config import PoolerConfig

        kw["pooler_config"] = PoolerConfig(**kw["pooler_config"])
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0

    def prompt(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        return TokensPrompt(prompt_token_ids=torch.randint(10, 1000, (n,), generator=g).tolist())

    def params(p, reuse: int):
        if mode == "raw":
            return PoolingParams(task="embed")
        ids = p["prompt_token_ids"]
        spec: HeadSpec = synthetic_spec(len(ids))
        if reuse:       # the first `reuse` tokens are a state the cache may hold (as the front end keys them)
            spec = spec.with_reuse(ids, reuse)
        return pooling_params(spec, reads=bool(reuse))

    def once(prompts, reuse: int = 0) -> float:
        t = time.perf_counter()
        task = "embed" if mode == "raw" else "plugin"
        llm.encode(prompts, pooling_params=[params(p, reuse) for p in prompts], pooling_task=task, use_tqdm=False)
        return (time.perf_counter() - t) * 1000

    for n in (64, 300, 400, 417, 1000, 1024, 4096):          # every kernel specialisation and graph bucket
        once([prompt(n, n)])
        once([prompt(n, n + 1)])
    res = {"mode": mode, "quantization": quantization, "nvfp4_kernel": nvfp4_kernel, "engine_process": engine_process,
           "engine_start_s": round(start_s, 1)}
    profile = (lambda request, n=5: {}) if engine_process else profiled    # the profiler sees this process only
    if sweep:                   # one request of exactly each bucket size: its step's cost
        for n in sweep:
            once([prompt(n, 30000 + n)])
        res["sweep"] = [{"tokens": n, "p50_ms": round(statistics.median(once([prompt(n, 40000 + 16 * n + i)])
                                                                         for i in range(10)), 3)}
                        for n in sweep]
    elif not followups_only:
        for n in LENGTHS:
            walls = [once([prompt(n, 1000 + i)]) for i in range(20)]
            res[f"single_{n}_p50_ms"] = round(statistics.median(walls), 1)
        batch = [prompt(400, 9000 + i) for i in range(256)]
        once(batch[:64])
        res["batch256x400_tok_s"] = round(256 * 400 / once(batch) * 1000)
        res.update(profile(lambda i: once([prompt(400, 7000 + i)])))
    if mode in CACHE_MODES:     # follow-ups on one cached state: STATE_TOKENS shared, 400 new tokens each
        state = prompt(STATE_TOKENS, 4242)["prompt_token_ids"]

        def follow_up(i: int) -> float:
            return once([TokensPrompt(prompt_token_ids=state + prompt(400, 5000 + i)["prompt_token_ids"])],
                        reuse=STATE_TOKENS)

        res["followup_first_ms"] = round(follow_up(0), 1)
        res["followup_p50_ms"] = round(statistics.median(follow_up(i) for i in range(1, 21)), 1)
        res["followup"] = profile(lambda i: follow_up(100 + i))
        small = prompt(BURST_STATE, 4343)["prompt_token_ids"]

        def burst(n: int, seed: int) -> float:     # n follow-ups on the 4k state, submitted together
            return once([TokensPrompt(prompt_token_ids=small + prompt(BURST_NEW, seed + i)["prompt_token_ids"])
                         for i in range(n)], reuse=BURST_STATE)

        burst(2, 60000)                             # the state is cached from its second request on
        res["burst_ms"] = {n: round(statistics.median(burst(n, 61000 + 1000 * k) for k in range(3)), 1)
                           for n in (1, 16, 64)}
        res["burst64"] = profile(lambda i: burst(64, 70000 + 1000 * i), n=2)
    if mode != "raw":
        def report(worker):
            model = worker.model_runner.model
            out = {f"{name}_graphs": runner.describe() for name, runner in model.graph_runners().items()}
            from clef_vllm.worker.fast import state_cache

            if state_cache.current() is not None:
                out["state_cache"] = state_cache.current().describe()
            return out

        try:
            res["worker"] = llm.collective_rpc(report)[0]
        except Exception as exc:  # noqa: BLE001 - a report only
            res["worker"] = f"unavailable: {type(exc).__name__}: {exc}"
    return res


def main() -> int:
    from clef_vllm.contract import NVFP4_KERNELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="graphs,nographs")
    ap.add_argument("--ckpt", type=Path, default=None, help="checkpoint (default: a generated 9B-shaped config folder)")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (online)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--followups-only", action="store_true",
                    help="cache modes: only the follow-ups and bursts (no single lengths, batch or 400-token profile)")
    ap.add_argument("--engine-process", action="store_true",
                    help="the engine core in its own process, as in the server (timings only, no profile)")
    ap.add_argument("--sweep", default=None, metavar="LO:HI:STEP",
                    help="modes graphs and step: a bucket at every size LO..HI, each timed alone")
    ap.add_argument("--nvfp4-kernel", default="vllm", choices=NVFP4_KERNELS,
                    help="a quantized checkpoint's NVFP4 layers: vLLM's kernel or BF16 GEMMs on weights dequantized "
                         "at load (the server's --nvfp4-kernel; raw mode keeps vLLM's)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)     # child: run one mode, print JSON
    a = ap.parse_args()
    unknown = sorted(set(a.modes.split(",")) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}")
    sweep = None
    if a.sweep:
        if set([a.one] if a.one else a.modes.split(",")) - {"graphs", "step"}:   # a child runs one mode
            ap.error("--sweep is for the modes graphs and step (the prefill graphs hold the buckets)")
        try:
            sweep = sweep_sizes(a.sweep)
        except ValueError as exc:
            ap.error(f"--sweep: {exc}")
    if a.one:
        print("RESULT " + json.dumps(run_mode(a.one, a.ckpt, a.quantization, a.followups_only,
                                                        a.engine_process, sweep, a.nvfp4_kernel)), flush=True)
        return 0
    ckpt = a.ckpt
    if ckpt is None:
        from clef_vllm.model.release import write_config_only_checkpoint

        ckpt = Path(tempfile.mkdtemp()) / "clef-9b"
        write_config_only_checkpoint(ckpt, layout="repacked")
    results = []
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--one", mode, "--ckpt", str(ckpt)]
        if a.quantization:
            cmd += ["--quantization", a.quantization]
        if a.followups_only:
            cmd.append("--followups-only")
        if a.engine_process:
            cmd.append("--engine-process")
        if a.sweep:
            cmd += ["--sweep", a.sweep]
        if a.nvfp4_kernel != "vllm":
            cmd += ["--nvfp4-kernel", a.nvfp4_kernel]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        res = json.loads(lines[-1]) if lines else {"mode": mode, "error": proc.returncode,
                                                   "log_tail": (proc.stdout + proc.stderr)[-3000:]}
        print(json.dumps(res), flush=True)
        results.append(res)
    if a.out:
        a.out.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

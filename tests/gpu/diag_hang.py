"""Diagnose a hang: one engine in process, a few prompts one at a time; once the engine is up, every
thread's Python stack is dumped every DUMP s, and the process exits after 3 dumps.

    python3 tests/gpu/diag_hang.py CKPT [--graphs] [--cache] [--big] [--len 300,1000 | --len server]

``--len server``: the server's warm-up, in its order (``warmup_lengths``, then ``warmup_batches``), with
the server's pooling parameters (``skip_reading_prefix_cache``).
"""
import argparse
import faulthandler
import logging
import os
import threading
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
ap = argparse.ArgumentParser()
ap.add_argument("ckpt")
ap.add_argument("--graphs", action="store_true")
ap.add_argument("--cache", action="store_true")
ap.add_argument("--len", default="300,1000,17")
ap.add_argument("--dump", type=float, default=25)
ap.add_argument("--big", action="store_true", help="the server's settings instead of fast_paths'")
args = ap.parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
from vllm import LLM, TokensPrompt  # noqa: E402

from clef_vllm import register  # noqa: E402
from clef_vllm.backends.vllm_backend import (engine_kwargs, pooling_params, warmup_batches,  # noqa: E402
                                             warmup_lengths)
from clef_vllm.model.features import synthetic_spec  # noqa: E402

register()
if args.big:
    kw = engine_kwargs(args.ckpt, load_format="dummy", max_model_len=16384, state_cache=args.cache,
                       prefill_graphs=args.graphs)
else:
    kw = engine_kwargs(args.ckpt, gpu_memory_utilization=0.3, max_num_seqs=32, max_num_batched_tokens=2048,
                       max_model_len=4096, prefill_graphs=args.graphs, state_cache=args.cache)
kw.pop("disable_log_stats", None)
llm = LLM(**kw)
print("DIAG engine up", flush=True)
faulthandler.dump_traceback_later(args.dump, repeat=True)
threading.Timer(3.2 * args.dump, lambda: os._exit(3)).start()
lengths = warmup_lengths(kw) if args.len == "server" else [int(x) for x in args.len.split(",")]
steps = [[n] for n in lengths]
if args.len == "server":            # then the server's batches
    steps += warmup_batches(kw)
for k, step in enumerate(steps):
    t0 = time.time()
    prompts = [TokensPrompt(prompt_token_ids=[5 + (i * 7 + k) % 200 for i in range(n)]) for n in step]
    params = [pooling_params(synthetic_spec(n)) for n in step]
    r = llm.encode(prompts, pooling_params=params, pooling_task="plugin", use_tqdm=False)
    print("DIAG", step if len(step) < 4 else f"{len(step)} x {step[0]}", "ok", round(time.time() - t0, 2),
          tuple(r[0].outputs.data.shape), flush=True)
print("DIAG all done", flush=True)
os._exit(0)

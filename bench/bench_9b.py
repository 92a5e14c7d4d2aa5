"""9B-shaped Clef-Flash throughput/latency with dummy weights (issue 3c), next to raw vLLM pooling.

Modes (run each in its own process; ``bench/run_9b.sh`` drives them):
  clef   ClefFlashForDecision through the plugin's vLLM backend (AsyncLLM, head in the worker):
         ~300-token requests with 3 questions (noul, choice, score), encoded by the plugin.
  raw    vLLM's own Qwen3_5ForCausalLM as an ``embed`` pooling model (no head, no encoding),
         fed the SAME token id lists through the same AsyncLLM call pattern.
  head   the joint head alone on the GPU (release dims, bf16): ms per batch of finished records.

Both engines: dummy weights, bf16 (or online ``--quant fp8``), prefix caching off, chunked
prefill on, fp32 mamba SSM cache, Triton GDN prefill, identical max_num_seqs /
max_num_batched_tokens / gpu_memory_utilization / compilation settings.

    python bench/bench_9b.py --mode clef --quant none --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

COMMON = dict(enable_prefix_caching=False, enable_chunked_prefill=True, mamba_ssm_cache_dtype="float32",
              gdn_prefill_backend="triton", skip_tokenizer_init=True, disable_log_stats=True, seed=0)


def workdir() -> Path:
    return Path(os.environ.get("CLEF_BENCH_DIR", tempfile.gettempdir())) / "clef-9b"


def prepare(root: Path) -> tuple[Path, Path]:
    """9B config-only checkpoints: ours (repacked layout, int8 tables) and a text-only raw one."""
    from clef_vllm.testing.release import clef_flash_config, write_config_only_checkpoint

    ours, raw = root / "clef-9b", root / "raw-9b"
    if not ours.exists():
        root.mkdir(parents=True, exist_ok=True)
        write_config_only_checkpoint(ours, layout="repacked")
        raw.mkdir()
        text = clef_flash_config()["text_config"]
        text["architectures"] = ["Qwen3_5ForCausalLM"]
        (raw / "config.json").write_text(json.dumps(text, indent=2))
    return ours, raw


def make_requests(encoder, n: int, target_tokens: int, seed: int = 0) -> list:
    """n SystemOne requests of ~target_tokens tokens with 3 questions, encoded."""
    import random

    from clef_vllm.protocol import parse_request

    rng = random.Random(seed)
    words = ("order invoice payment refund customer account outage server error login team billing urgent "
             "delivery address product price plan upgrade cancel status paid overdue ticket support").split()
    out = []
    for i in range(n):
        questions = {
            "urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
            "team": {"type": "choice", "instructions": "Which team should handle it?",
                     "criteria": {"billing": "Payments, invoices, and refunds",
                                  "technical": "Outages, errors, and configuration", "sales": "Plans and upgrades"}},
            "severity": {"type": "score", "instructions": "How severe is the impact?",
                         "criteria": ["No impact", "Minor", "Major", "Critical"]},
        }
        state_words = []
        body = {"model": "clef-flash", "state": "", "questions": questions}
        base = encoder.encode(parse_request(body)).num_tokens
        while True:  # grow the state to the target length
            state_words.extend(rng.choice(words) for _ in range(16))
            body["state"] = f"Ticket {i}: " + " ".join(state_words)
            enc = encoder.encode(parse_request(body))
            if enc.num_tokens >= target_tokens or enc.num_tokens - base > 4 * target_tokens:
                break
        out.append(enc)
    return out


def percentile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(submit, batches: list, singles: list) -> dict:
    """Throughput over all of ``batches`` at once, then sequential single-request latency."""
    await asyncio.gather(*[submit(x) for x in batches[:64]])  # extra warm-up of the batch shapes
    t0 = time.perf_counter()
    await asyncio.gather(*[submit(x) for x in batches])
    wall = time.perf_counter() - t0
    lat = []
    for x in singles:
        t = time.perf_counter()
        await submit(x)
        lat.append((time.perf_counter() - t) * 1000)
    return {"throughput_wall_s": round(wall, 3), "requests_per_s": round(len(batches) / wall, 1),
            "single_p50_ms": round(statistics.median(lat), 2), "single_p90_ms": round(percentile(lat, 0.9), 2),
            "single_min_ms": round(min(lat), 2)}


def run_clef(args, ours: Path) -> dict:
    from clef_vllm.backends.vllm_backend import VllmBackend

    opts = dict(load_format="dummy", gpu_memory_utilization=args.gpu_util, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.eager,
                max_model_len=args.max_model_len)
    if args.quant == "fp8":
        opts["quantization"] = "fp8"
    t0 = time.perf_counter()
    backend = VllmBackend(ours, **opts)
    start_s = time.perf_counter() - t0
    reqs = make_requests(backend.encoder, args.n, args.tokens)
    tokens = sum(r.num_tokens for r in reqs)

    async def submit(enc):
        return await backend._decide(enc)

    fut = asyncio.run_coroutine_threadsafe(measure(submit, reqs, reqs[: args.singles]), backend._loop)
    res = fut.result()
    res.update(engine_start_s=round(start_s, 1), input_tokens=tokens, mean_tokens=round(tokens / len(reqs), 1),
               tokens_per_s=round(tokens / res["throughput_wall_s"], 0))
    backend.close()
    return res


def run_raw(args, raw: Path) -> dict:
    from vllm import AsyncEngineArgs, PoolingParams, TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    from clef_vllm.encoding import RequestEncoder

    reqs = make_requests(RequestEncoder.from_pretrained(prepare(workdir())[0]), args.n, args.tokens)
    ids = [r.input_ids for r in reqs]
    kw = dict(COMMON, model=str(raw), runner="pooling", convert="embed", load_format="dummy", dtype="bfloat16",
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_util, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.eager)
    if args.quant == "fp8":
        kw["quantization"] = "fp8"
    loop = asyncio.new_event_loop()
    counter = iter(range(10**9))

    async def main():
        t0 = time.perf_counter()
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        start = time.perf_counter() - t0

        async def submit(x):
            final = None
            async for out in engine.encode(TokensPrompt(prompt_token_ids=x), PoolingParams(task="embed"),
                                           request_id=f"raw-{next(counter)}"):
                final = out
            return final

        for n in (64, 300, 1024, 4096, args.max_num_batched_tokens + 17):  # same warm-up shapes as ours
            await submit(list(range(1, min(n, args.max_model_len) + 1)))
        res = await measure(submit, ids, ids[: args.singles])
        engine.shutdown()
        return start, res

    start, res = loop.run_until_complete(main())
    tokens = sum(len(x) for x in ids)
    res.update(engine_start_s=round(start, 1), input_tokens=tokens, tokens_per_s=round(tokens / res["throughput_wall_s"], 0))
    return res


def run_head(args) -> dict:
    import torch

    from clef_vllm.features import HeadSpec, RecordAccumulator, accumulate, decide_records
    from clef_vllm.head import JointSchemaHead
    from clef_vllm.tables import Int8RowTable
    from clef_vllm.testing.release import RELEASE_HEAD_CONFIG
    from clef_vllm.worker.pooler import synthetic_spec

    dev = torch.device("cuda")
    head = JointSchemaHead(RELEASE_HEAD_CONFIG).to(dev, torch.bfloat16).eval()
    table = Int8RowTable(torch.randint(-127, 127, (248320, 4096), dtype=torch.int8, device=dev),
                         torch.rand(248320, device=dev) * 0.01)
    out = {}
    with torch.inference_mode():
        for batch, length in ((1, 300), (8, 300), (64, 300), (1, 4096), (1, 16384)):
            spec: HeadSpec = synthetic_spec(length)
            hidden = torch.randn(batch * length, 4096, device=dev, dtype=torch.bfloat16)

            def once():
                accs = [RecordAccumulator(spec) for _ in range(batch)]
                accumulate(head, hidden, [(a, i * length, length, 0) for i, a in enumerate(accs)])
                return decide_records(head, table, accs)

            for _ in range(3):
                once()
            torch.cuda.synchronize()
            t = time.perf_counter()
            reps = 10
            for _ in range(reps):
                once()
            torch.cuda.synchronize()
            out[f"b{batch}_L{length}_ms"] = round((time.perf_counter() - t) / reps * 1000, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["clef", "raw", "head"], required=True)
    ap.add_argument("--quant", choices=["none", "fp8"], default="none")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--singles", type=int, default=50)
    ap.add_argument("--gpu-util", type=float, default=0.85)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    ours, raw = prepare(workdir())
    if args.mode == "clef":
        res = run_clef(args, ours)
    elif args.mode == "raw":
        res = run_raw(args, raw)
    else:
        res = run_head(args)
    res = {"mode": args.mode, "quant": args.quant, "eager": args.eager, "n": args.n, "tokens_target": args.tokens,
           **res}
    print(json.dumps(res), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "bench_9b.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

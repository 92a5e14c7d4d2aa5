"""Requests with an image through the vLLM backend next to raw vLLM multimodal pooling of the same inputs.

One GPU, one process, the engines one after another at the same ``--gpu-memory-utilization``:

* **clef**: the vLLM backend (the server's engine, head in the worker) on ``--ckpt``; every request one
  ``--image-px`` square picture (a different one each) and a ~300-token state, three questions;
* **raw**: vLLM's own ``Qwen3_5ForConditionalGeneration`` with ``embed`` pooling (last token, no head) on the
  same checkpoint, the same collapsed prompt ids and the same pictures;
* **text-only** (``--text-only-too``): the vLLM backend with ``--text-only``, for the memory the tower takes.

Measured per engine: c=1 latency (p50 over ``--c1`` requests), c=16 throughput (``--n`` requests), and for clef the
same picture and state asked twice with other questions (the second answer's latency over the first). The engines'
memory lines (vLLM's "Model loading took", "Available KV cache memory", the plugin's budget line) go to the log.

    source bench/setup.sh && python3 bench/make_ckpt.py 9b /root/ckpt/h --hybrid 17
    python3 bench/media_speed.py --ckpt /root/ckpt/h --out $OUT/media_speed.json 2>&1 | tee $OUT/media_speed.log

``--host-memory`` measures instead (CPU only, no engine) what the server's media budget (``--max-media-memory``) is
sized by: the peak resident memory of encoding one request with media, over its pixels, each case in a fresh
process, with the reference backend's encoder (the processor's tensors) and the vLLM front end's (the decoded
frames kept for vLLM; vLLM's own processor then runs like the reference's):

    python3 bench/make_ckpt.py tiny /tmp/tiny && python3 bench/media_speed.py --host-memory --ckpt /tmp/tiny \
        --out bench/results/media_host_memory.json

``--front-end-videos N`` measures (CPU only, torchvision installed) the vLLM front end's encoding of N requests with
one video each (16 JPEG frames of 1280 x 720, other pictures every time): decoding, and the checkpoint's processor
for the ids only where no video of that size came lately (its ids cache off, then on):

    python3 bench/media_speed.py --front-end-videos 8 --ckpt /tmp/tiny --out bench/results/media_front_end_videos.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

QUESTIONS = [{"urgent": {"type": "noul", "instructions": "Does the screenshot show an outage?"},
              "kind": {"type": "choice", "criteria": {"invoice": "A scanned invoice", "error": "An error screen",
                                                      "photo": "A photo"}},
              "severity": {"type": "score", "criteria": ["none", "low", "high"]}},
             {"blocked": {"type": "noul", "instructions": "Is the user blocked from paying?"},
              "product": {"type": "choice", "criteria": {"workers": "Workers", "r2": "R2", "dns": "DNS"}}}]


def bodies(n: int, px: int, seed: int, questions: int = 0) -> list[dict]:
    from clef_vllm.testing.images import data_uri, picture

    words = "the checkout page shows an error after the card is entered and the spinner never stops".split()
    out = []
    for i in range(n):
        state = " ".join(words[(i + k) % len(words)] for k in range(220))
        out.append({"model": "clef-flash", "state": f"ticket {seed}-{i}: {state}", "questions": QUESTIONS[questions],
                    "images": [data_uri(picture((px, px), seed * 10_000 + i, "JPEG"), "image/jpeg")]})
    return out


def encode_all(encoder, items: list[dict]):
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.media import decode_media

    out = []
    for body in items:
        request = parse_request(body)
        decode_media(request._media)
        out.append(encoder.encode(request))
    return out


async def closed_loop(send, items, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(item):
        async with sem:
            t = time.perf_counter()
            await send(item)
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(x) for x in items])
    wall = time.perf_counter() - t0
    latencies.sort()
    return {"requests": len(items), "concurrency": concurrency, "req_per_s": round(len(items) / wall, 2),
            "p50_ms": round(1000 * statistics.median(latencies), 2),
            "p90_ms": round(1000 * latencies[int(0.9 * (len(latencies) - 1))], 2)}


def clef_run(args, text_only: bool = False) -> dict:
    from clef_vllm.backends import make_backend
    from clef_vllm.worker.dummy_loader import dummy_format_for

    config = json.loads((Path(args.ckpt) / "config.json").read_text())
    backend = make_backend(args.ckpt, "vllm", load_format=dummy_format_for(config), text_only=text_only,
                           gpu_memory_utilization=args.gpu_memory_utilization)
    try:
        if text_only:
            return {"engine": "clef --text-only", "plan": backend.memory_plan.to_dict() if backend.memory_plan else None}
        warm, c1, many = (encode_all(backend.encoder, bodies(k, args.image_px, seed))
                          for k, seed in ((8, 1), (args.c1, 2), (args.n, 3)))
        asked = bodies(args.repeats, args.image_px, 4)
        first = encode_all(backend.encoder, asked)
        second = encode_all(backend.encoder, [b | {"questions": QUESTIONS[1]} for b in asked])   # the same pictures
        run = backend._submit
        run(closed_loop(backend._decide, warm, 4)).result()
        out = {"engine": "clef", "tokens_per_request": round(statistics.mean(e.num_tokens for e in many), 1),
               "media_tokens": many[0].media_tokens, "c1": run(closed_loop(backend._decide, c1, 1)).result(),
               "c16": run(closed_loop(backend._decide, many, 16)).result()}
        pairs = []
        for a, b in zip(first, second):
            t0 = time.perf_counter()
            run(backend._decide(a)).result()
            t1 = time.perf_counter()
            run(backend._decide(b)).result()
            pairs.append((t1 - t0, time.perf_counter() - t1, b.cached_state_tokens))
        out["repeat"] = {"pairs": len(pairs), "first_p50_ms": round(1000 * statistics.median(p[0] for p in pairs), 2),
                         "second_p50_ms": round(1000 * statistics.median(p[1] for p in pairs), 2),
                         "cached_tokens_second": [p[2] for p in pairs]}
        out["repeat"]["speedup"] = round(out["repeat"]["first_p50_ms"] / out["repeat"]["second_p50_ms"], 2)
        out["plan"] = backend.memory_plan.to_dict() if backend.memory_plan else None
        return out
    finally:
        backend.close()


def raw_run(args, encoded_like) -> dict:
    from vllm import AsyncEngineArgs, PoolingParams
    from vllm.config import PoolerConfig
    from vllm.v1.engine.async_llm import AsyncLLM

    from clef_vllm.backends.vllm_media import media_prompt
    from clef_vllm.bench.raw_vllm import raw_engine_kwargs

    kwargs = raw_engine_kwargs(args.ckpt, arch="Qwen3_5ForConditionalGeneration",
                               gpu_memory_utilization=args.gpu_memory_utilization)
    kwargs.pop("language_model_only", None)
    kwargs["skip_tokenizer_init"] = False          # vLLM's image processor needs the tokenizer
    kwargs["pooler_config"] = PoolerConfig(**kwargs["pooler_config"])
    params = PoolingParams(task="embed")
    pad, warm, c1, many = encoded_like

    async def main():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        ids = iter(range(10 ** 9))

        async def send(e):
            async for _ in engine.encode(media_prompt(e, pad), params, request_id=f"raw-{next(ids)}"):
                pass
        try:
            await closed_loop(send, warm, 4)
            return {"engine": "raw vLLM Qwen3_5ForConditionalGeneration embed",
                    "c1": await closed_loop(send, c1, 1), "c16": await closed_loop(send, many, 16)}
        finally:
            engine.shutdown()

    return asyncio.run(main())


#: --host-memory's cases: (name, sizes of its images, frames of its one video and their size)
HOST_CASES = (("one 3072x3072 JPEG", [3072], 0, 0), ("four 1536x1536 JPEGs", [1536] * 4, 0, 0),
              ("a video of 16 1024x1024 frames", [], 16, 1024))


def host_case(ckpt: str, case: int, pixels: bool) -> dict:
    """Encode one request of ``HOST_CASES[case]`` in this (fresh) process: its pixels and the peak RSS it added."""
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.media import decode_media
    from clef_vllm.testing.images import QUESTIONS as ASKED
    from clef_vllm.testing.images import data_uri, picture, video_frames

    name, sizes, frames, side = HOST_CASES[case]
    encoder = RequestEncoder.from_pretrained(ckpt, pixels=pixels)
    body = {"model": "clef-flash", "state": "the invoice total does not match the order", "questions": ASKED,
            "images": [data_uri(picture((px, px), i, "JPEG"), "image/jpeg") for i, px in enumerate(sizes)]}
    if frames:
        body["videos"] = [video_frames((side, side), frames, 1, "JPEG")]
    request = parse_request(body)
    decode_media(request._media)
    pixel_count = sum(i.width * i.height * i.frames for i in request._media)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    encoded = encoder.encode(request)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"case": name, "encoder": "reference (pixels)" if pixels else "vLLM front end (frames kept)",
            "pixels": pixel_count, "media_tokens": encoded.media_tokens,
            "peak_added_mib": round((peak - before) / 2 ** 20, 1),
            "bytes_per_pixel": round((peak - before) / pixel_count, 1)}


def host_memory(args) -> int:
    rows = []
    for case in range(len(HOST_CASES)):
        for pixels in (True, False):
            run = subprocess.run([sys.executable, __file__, "--ckpt", args.ckpt, "--out", "-", "--host-case",
                                  f"{case}:{int(pixels)}"], capture_output=True, text=True)
            if run.returncode:
                reason = (run.stderr.strip().splitlines() or ["failed"])[-1]
                rows.append({"case": HOST_CASES[case][0], "pixels": pixels, "skipped": reason})
            else:
                rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    import torch
    import transformers

    report = {"command": " ".join(sys.argv[1:]), "torch": torch.__version__, "transformers": transformers.__version__,
              "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def front_end_videos(args) -> int:
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.media import decode_media
    from clef_vllm.schema.media_inputs import VIDEO_IDS_BYTES, VIDEO_IDS_ITEMS
    from clef_vllm.testing.images import QUESTIONS as ASKED
    from clef_vllm.testing.images import video_frames
    from clef_vllm.util.lru import SizedLRU

    encoder = RequestEncoder.from_pretrained(args.ckpt, pixels=False)
    bodies = [{"model": "clef-flash", "state": "the checkout page froze", "questions": ASKED,
               "videos": [video_frames((1280, 720), 16, seed, "JPEG")]} for seed in range(args.front_end_videos + 1)]

    def encode_ms(body: dict) -> float:
        t0 = time.perf_counter()
        request = parse_request(body)
        decode_media(request._media)
        encoder.encode(request)
        return (time.perf_counter() - t0) * 1000

    encode_ms(bodies[-1])                   # the processor's first call (its imports) is not measured
    import torchvision
    import transformers

    report = {"command": " ".join(sys.argv[1:]), "video": "16 JPEG frames of 1280 x 720",
              "transformers": transformers.__version__, "torchvision": torchvision.__version__, "runs": {}}
    for label, ids in (("ids cache off", SizedLRU(0)), ("ids cache on", SizedLRU(VIDEO_IDS_BYTES, VIDEO_IDS_ITEMS))):
        encoder.media._video_ids = ids
        ms = [round(encode_ms(b), 1) for b in bodies[:-1]]
        report["runs"][label] = {"median_ms": statistics.median(ms), "ms": ms}
        print(label, report["runs"][label], flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--image-px", type=int, default=512)
    ap.add_argument("--c1", type=int, default=24)
    ap.add_argument("--n", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--skip-raw", action="store_true")
    ap.add_argument("--text-only-too", action="store_true")
    ap.add_argument("--host-memory", action="store_true", help="the host memory a request's media cost (CPU only)")
    ap.add_argument("--host-case", default=None, help=argparse.SUPPRESS)     # one --host-memory case, in its process
    ap.add_argument("--front-end-videos", type=int, default=0, metavar="N",
                    help="the vLLM front end's encoding of N requests with a video (CPU only)")
    args = ap.parse_args()
    if args.host_case is not None:
        case, pixels = args.host_case.split(":")
        print(json.dumps(host_case(args.ckpt, int(case), pixels == "1")))
        return 0
    if args.host_memory:
        return host_memory(args)
    if args.front_end_videos:
        return front_end_videos(args)
    import torch

    from clef_vllm.schema.encoding import RequestEncoder

    report = {"gpu": torch.cuda.get_device_name(0), "ckpt": args.ckpt, "image_px": args.image_px,
              "gpu_memory_utilization": args.gpu_memory_utilization, "runs": []}
    report["runs"].append(clef_run(args))
    args.out.write_text(json.dumps(report, indent=2))
    if not args.skip_raw:
        encoder = RequestEncoder.from_pretrained(args.ckpt, pixels=False)
        encoded = (encoder.media.pad_id, *(encode_all(encoder, bodies(k, args.image_px, seed))
                                           for k, seed in ((8, 1), (args.c1, 2), (args.n, 3))))
        raw = raw_run(args, encoded)
        ours = report["runs"][0]
        raw["clef_over_raw"] = {"c1_p50": round(raw["c1"]["p50_ms"] / ours["c1"]["p50_ms"], 3),
                                "c16_req_per_s": round(ours["c16"]["req_per_s"] / raw["c16"]["req_per_s"], 3)}
        report["runs"].append(raw)
        args.out.write_text(json.dumps(report, indent=2))
    if args.text_only_too:
        report["runs"].append(clef_run(args, text_only=True))
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU check: requests with images and videos through the vLLM backend, against the reference backend on the same
GPU.

For each layout (release, repacked) of a tiny checkpoint built on the spot, N generated requests with 0-4 images
each (PNG/JPEG/WebP, RGB/RGBA/grey, 40x40 to 530x530, tall and wide; ``clef_vllm.testing.images``) and V with one
video each (2-9 PNG/JPEG frames or an animated GIF, after 0-2 images; vLLM's processor expands each video's
placeholder to its timestamps and frames' pads) go through
``Clef(backend="vllm")`` (vLLM's processor expands each image's pad, its vision tower and encoder cache run, the
step's chunks may cut through an image) and through ``Clef(backend="reference", device="cuda")``: token ids must
be identical (the vLLM backend also checks vLLM's expanded ids against the encoder's, per request), top answers
may differ only at near-ties (reference top-2 margin below 2 max|dp|). The same engine then answers the requests
again in another order with the state cache on (images repeated: the encoder cache and the cached states), which
must give the same answers.

Usage (GPU machine, vLLM on PYTHONPATH): python tests/gpu/vllm_media.py --out $OUT --n 200 --videos 60
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from vllm_parity import compare  # the text parity run's comparison (this script's folder is on sys.path)


def parity(layout: str, n: int, workdir: Path, engine: dict, videos: int = 0) -> dict:
    import torch

    from clef_vllm import Clef
    from clef_vllm.model.tiny import build_tiny_checkpoint
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.media import decode_media
    from clef_vllm.testing.images import image_requests, video_requests

    def encode(backend, body):
        req = parse_request(body)
        decode_media(req._media)
        return backend.encoder.encode(req)

    ckpt = build_tiny_checkpoint(workdir / f"tiny-{layout}", layout=layout, mtp=True)
    bodies = image_requests(n, seed=5) + video_requests(videos, seed=7)
    n = len(bodies)
    t0 = time.perf_counter()
    with Clef(ckpt, backend="vllm", **engine) as vl:
        start_s = time.perf_counter() - t0
        encoded = [encode(vl.backend, b) for b in bodies]
        t1 = time.perf_counter()
        got = vl.systemone_batch(bodies)
        vllm_s = time.perf_counter() - t1
        order = list(range(n))
        random.Random(1).shuffle(order)
        again = vl.systemone_batch([bodies[i] for i in order])
        repeat = compare([got[i] for i in order], again)
    with Clef(ckpt, backend="reference", device="cuda") as ref:
        ref_encoded = [encode(ref.backend, b) for b in bodies]
        t2 = time.perf_counter()
        want = ref.systemone_batch(bodies)
        ref_s = time.perf_counter() - t2
    images = [len(b["images"]) for b in bodies]
    lengths = [e.num_tokens for e in encoded]
    frames = [e.media.videos[0][0].shape[0] for e in encoded if e.media is not None and e.media.videos]
    return {"layout": layout, "requests": n, "images": {k: images.count(k) for k in sorted(set(images))},
            "videos": len(frames), "video_frames": {k: frames.count(k) for k in sorted(set(frames))},
            "video_tokens": sorted({e.media.token_counts[-1] for e in encoded if e.media is not None
                                    and e.media.videos})[::max(1, len(frames) // 8)],
            "token_ids_identical": sum(a.input_ids == b.input_ids for a, b in zip(encoded, ref_encoded)),
            "tokens": {"min": min(lengths), "max": max(lengths), "mean": round(sum(lengths) / n, 1),
                       "chunked": sum(x > engine["max_num_batched_tokens"] for x in lengths)},
            "media_tokens": {"min": min(e.media_tokens for e in encoded), "max": max(e.media_tokens for e in encoded)},
            "engine_start_s": round(start_s, 1), "vllm_batch_s": round(vllm_s, 2), "reference_batch_s": round(ref_s, 2),
            "gpu": torch.cuda.get_device_name(0), **compare(want, got),
            "again_shuffled": {k: v for k, v in repeat.items() if k != "flips"}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--videos", type=int, default=60, help="requests with a video, after the N with images")
    ap.add_argument("--layouts", default="release,repacked")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = dict(gpu_memory_utilization=0.35, max_num_batched_tokens=512, max_num_seqs=32)
    workdir = Path(tempfile.mkdtemp(prefix="clef-gpu-media-"))
    failed = False
    for layout in args.layouts.split(","):
        report = parity(layout, args.n, workdir, engine, args.videos)
        (out / f"media_parity_{layout}.json").write_text(json.dumps(report, indent=2))
        print(json.dumps({k: v for k, v in report.items() if k != "flips"}, indent=1), flush=True)
        failed |= report["token_ids_identical"] != report["requests"] or report["flips_not_near_ties"] > 0 \
            or report["again_shuffled"]["flips_not_near_ties"] > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

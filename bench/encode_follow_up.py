"""What encoding a follow-up costs: the real Qwen3.5 tokenizer, the ``shared-state`` workload's requests about one
state (15,872 and 4,096 tokens), every cache warm (CPU only).

    python bench/encode_follow_up.py [LABEL]

Prints the p50 / p10 / p90 ms of ``RequestEncoder.encode`` per state size over 3 x 36 follow-ups.
"""

from __future__ import annotations

import json
import sys
import time

from clef_vllm.bench.workloads import RequestFactory, build_variants
from clef_vllm.schema.dialects import parse_request
from clef_vllm.schema.encoding import RequestEncoder
from clef_vllm.testing.qwen_tokenizer import cached_qwen35_tokenizer


def main() -> None:
    enc = RequestEncoder.from_pretrained(str(cached_qwen35_tokenizer()), max_length=16384)
    factory = RequestFactory(enc)
    limits = enc.request_limits()
    out = {}
    for tokens, n in ((15872, 33), (4096, 64)):
        variant = build_variants(["shared-state"], shared_states=[(tokens, n)])[0]
        bodies = [json.dumps(factory.make(variant, i).body) for i in range(1, 40)]
        for body in bodies[:3]:                         # the state's first requests: every cache warm
            enc.encode(parse_request(json.loads(body), limits=limits))
        times = []
        for _ in range(3):
            for body in bodies[3:]:
                request = parse_request(json.loads(body), limits=limits)
                t0 = time.perf_counter()
                enc.encode(request)
                times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        out[tokens] = {"p50": round(times[len(times) // 2], 3), "p10": round(times[len(times) // 10], 3),
                       "p90": round(times[9 * len(times) // 10], 3)}
    print(sys.argv[1] if len(sys.argv) > 1 else "", json.dumps(out))


if __name__ == "__main__":
    main()

"""What vLLM 0.28's prefix-cache hashing costs per prompt at 16-token units (``--state-cache-match unit``)
against whole 528-token blocks (``block``): the engine core hashes every prompt when a request arrives.
CPU only.

    python bench/block_hashing.py > bench/results/cpu_block_hashing.txt
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import PoolingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    print("unit  prompt tokens  hashes  ms per prompt (Request + block hashes, median of 9)")
    for unit in (16, 528):
        hasher = get_request_block_hasher(unit, sha256)
        for n in (4490, 16268):
            ids = list(range(1000, 1000 + n))
            times = []
            for _ in range(9):
                t = time.perf_counter()
                r = Request("r", prompt_token_ids=ids, sampling_params=None,
                            pooling_params=PoolingParams(task="plugin"), block_hasher=hasher)
                times.append((time.perf_counter() - t) * 1000)
            print(f"{unit:4d}  {n:13d}  {len(r.block_hashes):6d}  {sorted(times)[4]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

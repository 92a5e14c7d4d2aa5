"""What prefix-cache hashing costs per prompt in the engine core when a request arrives: vLLM 0.28's own
hasher against the plugin's (a Clef request's keyed prefix takes its state keys as block hashes, so
only the tokens after it are hashed), at 16-token units (``--state-cache-match unit``) and whole
528-token blocks (``block``); and what the front-end pays to key the same prefix (``prefix_keys``: the
first time, and for a state keyed lately, from its memo). The prompts are a state plus 400 tokens, the
state keyed; a last column sends the same prompt unkeyed (a state's first sighting under
``--state-cache-admit repeat``), which the plugin's hasher does not hash at all. CPU only.

    python bench/block_hashing.py > bench/results/cpu_block_hashing.txt
"""

from __future__ import annotations

import os
import sys
import time

NEW_TOKENS = 400


def median_ms(fn, runs: int = 9) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return sorted(times)[runs // 2]


def measure(unit: int, n: int) -> str:
    """One row: a prompt of ``n`` tokens, its state (all but the last NEW_TOKENS) keyed, hashed at ``unit``."""
    from vllm import PoolingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from clef_vllm.contract import PARAMS_KEY
    from clef_vllm.schema import state_keys
    from clef_vllm.schema.state_keys import prefix_keys
    from clef_vllm.worker.scheduler import block_hasher

    ids = list(range(1000, 1000 + n))
    keys = prefix_keys(ids, n - NEW_TOKENS)
    params = PoolingParams(task="plugin", extra_kwargs={PARAMS_KEY: {"r": n - NEW_TOKENS, "k": keys}})
    hashers = {"vllm": get_request_block_hasher(unit, sha256),
               "clef": block_hasher(unit, sha256, get_request_block_hasher)}
    unkeyed = PoolingParams(task="plugin", extra_kwargs={PARAMS_KEY: {}})
    ms, hashes = {}, {}
    for name, hasher in hashers.items():
        for kind, p in (("", params), ("unkeyed ", unkeyed)):
            def build(hasher=hasher, key=kind + name, p=p):
                r = Request("r", prompt_token_ids=ids, sampling_params=None, pooling_params=p, block_hasher=hasher)
                hashes[key] = len(r.block_hashes)
            ms[kind + name] = median_ms(build)
    assert hashes["vllm"] == hashes["clef"] == hashes["unkeyed vllm"] and hashes["unkeyed clef"] == 0

    def cold():
        state_keys._memo.clear()
        prefix_keys(ids, n - NEW_TOKENS)

    front = median_ms(cold)
    again = median_ms(lambda: prefix_keys(ids, n - NEW_TOKENS))
    return (f"{unit:4d}  {n:13d}  {hashes['vllm']:6d}  vllm {ms['vllm']:.2f}  clef {ms['clef']:.2f}  "
            f"prefix_keys {front:.2f} (a state keyed lately: {again:.2f})  "
            f"unkeyed: vllm {ms['unkeyed vllm']:.2f}  clef {ms['unkeyed clef']:.2f}")


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    print(f"unit  prompt tokens  hashes  ms per prompt, median of 9: engine core (Request + block hashes) with vLLM's "
          f"hasher / with the plugin's; front-end prefix_keys of the state (prompt - {NEW_TOKENS} tokens), cold and "
          "memoised; the same prompt unkeyed, vLLM's hasher / the plugin's")
    for unit in (16, 528):
        for n in (4490, 16268):
            print(measure(unit, n))
    return 0


if __name__ == "__main__":
    sys.exit(main())

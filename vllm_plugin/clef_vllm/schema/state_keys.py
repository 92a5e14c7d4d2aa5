"""Content keys of a prompt's reusable prefix (the state cache's addressing; no vLLM, no torch).

The front-end keys the token ids before a request's first question/option span in units of
:data:`KEY_UNIT` tokens, chained, so key ``j`` identifies exactly the ids ``[0, (j + 1) * KEY_UNIT)`` and, for a
prompt with images, the images: their digest (``MediaInputs.digest``) seeds the chain, since every image's pads
are the same ids.
The worker stores the joint head's memory rows of a cached KV block under the key of the block's
last unit; the scheduler grants a prefix-cache hit only as far as such rows exist.
"""

from __future__ import annotations

import array
import hashlib
import sys
import threading
from collections import OrderedDict
from typing import Sequence

#: Tokens per key. vLLM's KV block sizes are multiples of 16 (its attention kernels require it).
KEY_UNIT = 16
#: A state (the prompt before its schema) shorter than this is never kept for reuse, by either backend (a KV
#: block of Qwen3.5-9B holds 528 tokens).
MIN_REUSE_TOKENS = 1024
#: Bytes per key (BLAKE2b digest size): a collision between two prefixes is out of reach (2^-128).
KEY_BYTES = 16
_PERSON = b"clef-state-v1"
#: Recent key lists, by one digest of the ids they key: follow-ups about one state skip ~1,000 chained
#: digests per 16k tokens (measured on the dev machine: 1.1-1.7 ms -> ~0.3 ms; bench/results/cpu_block_hashing.txt).
_MEMO_SIZE = 64
_memo: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
_memo_lock = threading.Lock()


def _uint32_le(token_ids: Sequence[int]) -> bytes:
    a = array.array("I", token_ids)          # C unsigned int: 4 bytes on every platform vLLM runs on
    if a.itemsize != 4:
        raise RuntimeError(f"array('I') has {a.itemsize}-byte items here; token keys need 4")
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def prefix_keys(token_ids: Sequence[int], upto: int, unit: int = KEY_UNIT, media: bytes = b"") -> list[bytes]:
    """Chained keys of ``token_ids[:upto]``, one per whole ``unit`` tokens (ids as little-endian uint32);
    ``media``: the digest of the prompt's images, which seeds the chain (none: a text prompt's keys)."""
    count = max(0, min(upto, len(token_ids)) // unit)
    if count == 0:
        return []
    data = _uint32_le(token_ids[:count * unit])
    memo = hashlib.blake2b(media + data, digest_size=KEY_BYTES, person=b"clef-memo-v1").digest() \
        + unit.to_bytes(4, "little") + len(media).to_bytes(2, "little")
    with _memo_lock:
        hit = _memo.get(memo)
        if hit is not None:
            _memo.move_to_end(memo)
            return list(hit)
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON)
    if media:
        h.update(media)
    step = unit * 4
    keys = []
    for j in range(count):
        h.update(data[j * step:(j + 1) * step])
        keys.append(h.copy().digest())
    with _memo_lock:
        _memo[memo] = tuple(keys)
        while len(_memo) > _MEMO_SIZE:
            _memo.popitem(last=False)
    return keys


def prefix_digest(token_ids: Sequence[int], upto: int, media: bytes = b"") -> bytes:
    """One key of exactly ``token_ids[:upto]`` (any length; the reference backend's state cache) and ``media``."""
    data = _uint32_le(token_ids[:upto])
    return hashlib.blake2b(media + data, digest_size=KEY_BYTES, person=b"clef-prefix-v1").digest()


def block_keys(unit_keys: Sequence[bytes], block: int, unit: int = KEY_UNIT) -> list[bytes]:
    """The key of each whole ``block``-token block the unit keys cover (its last unit's key)."""
    if block % unit:
        raise ValueError(f"block size {block} is not a multiple of the key unit {unit}")
    per = block // unit
    return [unit_keys[(k + 1) * per - 1] for k in range(len(unit_keys) // per)]


def state_key(token_ids: Sequence[int], state_end: int, media: bytes = b"") -> bytes:
    """The one key of the state ``token_ids[:state_end]`` that requests are routed by: its last whole unit's
    chained key (the key the vLLM backend's data-parallel affinity picks an engine by, so a state's requests meet
    the engine, or the replica, whose cache holds it), or the digest of a state shorter than one unit."""
    keys = prefix_keys(token_ids, state_end, media=media)
    return keys[-1] if keys else prefix_digest(token_ids, state_end, media)

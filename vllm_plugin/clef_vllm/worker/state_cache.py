"""The state cache's side store: the joint head's memory rows of prompt prefixes vLLM has cached.

vLLM's prefix cache keeps the K/V blocks (and, in ``align`` mode, the GDN state at block
boundaries) of prompts it has computed, so a later request with the same prefix skips those
tokens. The joint head, though, reads a 1024-wide *memory row* for EVERY prompt token; the rows of
skipped tokens must come from somewhere. This module keeps them.

Design (docs/state-cache.md):

* **Keys are content hashes** (:mod:`clef_vllm.state_keys`): the front-end keys the token ids of
  the reusable prefix (every token before the first question/option span) in chained units of
  16 tokens, so a key identifies an exact token prefix. Memory rows are a pure function
  of that prefix, so a row stored under a key can never be stale: there is no block id to be
  recycled, and a different prefix has a different key.
* **Blocks of vLLM's size.** Rows are stored per KV block of ``block`` tokens (vLLM's hybrid block
  size, a multiple of :data:`KEY_UNIT`) under the key of the block's last unit, in a fixed pool of
  GPU slots with LRU eviction. The pool is allocated during vLLM's memory profiling, so the KV
  cache is sized around it.
* **No hit without rows.** The scheduler (:mod:`clef_vllm.worker.scheduler`, same process as the
  worker) caps a request's prefix-cache hit at the rows present here; the pooler reads rows for
  the hit before it stores any new block in that step, so nothing granted is evicted before it
  is read.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from clef_vllm.state_keys import KEY_UNIT, block_keys, prefix_keys  # noqa: F401 - re-exported

log = logging.getLogger("clef_vllm")


@dataclass
class CacheStats:
    stored_blocks: int = 0
    read_blocks: int = 0
    evicted_blocks: int = 0
    missing_reads: int = 0
    hits: int = 0                   # requests that started from cached rows
    reused_tokens: int = 0


class SideCache:
    """A fixed pool of ``capacity`` blocks of ``block`` memory rows (``width`` wide), keyed by content."""

    def __init__(self, capacity: int, block: int, width: int, dtype: torch.dtype, device):
        if capacity < 1 or block < 1:
            raise ValueError("capacity and block must be >= 1")
        self.block = block
        self.capacity = capacity
        self.pool = torch.empty(capacity, block, width, dtype=dtype, device=device)
        self._slots: OrderedDict[bytes, int] = OrderedDict()      # key -> slot, least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def present_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` have rows here (a read needs all of them)."""
        n = 0
        for key in keys:
            if key not in self._slots:
                break
            n += 1
        return n

    def read(self, keys: Sequence[bytes]) -> torch.Tensor | None:
        """Rows of ``len(keys)`` consecutive blocks as one ``[n * block, width]`` tensor (one gather);
        ``None`` if any block is missing."""
        slots = []
        for key in keys:
            slot = self._slots.get(key)
            if slot is None:
                self.stats.missing_reads += 1
                return None
            self._slots.move_to_end(key)
            slots.append(slot)
        self.stats.read_blocks += len(slots)
        index = torch.tensor(slots, dtype=torch.long)
        if self.pool.device.type != "cpu":
            index = index.pin_memory().to(self.pool.device, non_blocking=True)
        return self.pool.index_select(0, index).view(-1, self.pool.shape[-1])

    def write(self, key: bytes, rows: torch.Tensor) -> None:
        """Store one block's rows (``[block, width]``) unless the key is already present."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return
        if rows.shape[0] != self.block:
            raise ValueError(f"a block has {self.block} rows, got {rows.shape[0]}")
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slots.popitem(last=False)
            self.stats.evicted_blocks += 1
        self.pool[slot].copy_(rows, non_blocking=True)
        self._slots[key] = slot
        self.stats.stored_blocks += 1

    def describe(self) -> dict:
        s = self.stats
        return {"capacity_blocks": self.capacity, "block_tokens": self.block, "blocks": len(self._slots),
                "bytes": self.nbytes, "stored_blocks": s.stored_blocks, "read_blocks": s.read_blocks,
                "evicted_blocks": s.evicted_blocks, "missing_reads": s.missing_reads, "hits": s.hits,
                "reused_tokens": s.reused_tokens}


# --------------------------------------------------------------------------- the process's cache

_cache: SideCache | None = None


def current() -> SideCache | None:
    """This process's side cache (``None`` until the worker created it: no hits are granted)."""
    return _cache


def install(cache: SideCache | None) -> None:
    global _cache
    _cache = cache


def capacity_for(budget_bytes: int, block: int, width: int, dtype: torch.dtype) -> int:
    """Blocks that fit in ``budget_bytes``."""
    per_block = block * width * dtype.itemsize
    return max(1, int(budget_bytes // per_block))


def side_share(width: int, head_dtype: torch.dtype, kv_bytes_per_token: int) -> float:
    """The fraction of a KV budget the side rows need to cover every token the KV cache can hold."""
    side = width * head_dtype.itemsize
    return side / (side + kv_bytes_per_token)

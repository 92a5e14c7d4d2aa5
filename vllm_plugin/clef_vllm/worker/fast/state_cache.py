"""The state cache's side store: the joint head's memory rows of prompt prefixes vLLM has cached.

vLLM's prefix cache keeps the K/V blocks (and, in ``align`` mode, the GDN state at block
boundaries) of prompts it has computed, so a later request with the same prefix skips those
tokens. The joint head, though, reads a 1024-wide *memory row* for EVERY prompt token; the rows of
skipped tokens must come from somewhere. This module keeps them.

Design (docs/state-cache.md):

* **Keys are content hashes** (:mod:`clef_vllm.schema.state_keys`): the front-end keys the token ids of
  the reusable prefix (every token before the first question/option span) in chained units of
  16 tokens, so a key identifies an exact token prefix. Memory rows are a pure function
  of that prefix, so a row stored under a key can never be stale: there is no block id to be
  recycled, and a different prefix has a different key.
* **Blocks of vLLM's size, and one tail.** Rows are stored per KV block of ``block`` tokens (vLLM's
  hybrid block size, a multiple of :data:`KEY_UNIT`) under the key of the block's last unit, in a
  fixed pool of GPU slots with LRU eviction. When vLLM matches prefixes at the key unit
  (``prefix_match_unit``), the rows from a reusable prefix's last block boundary to its end (its
  *tail*, shorter than a block) get one slot too, under the key of the prefix's last unit. The pool
  is allocated during vLLM's memory profiling, so the KV cache is sized around it.
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

from clef_vllm.schema.state_keys import KEY_UNIT, block_keys, prefix_keys  # noqa: F401 - re-exported

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
    """A fixed pool of ``capacity`` slots of up to ``block`` memory rows (``width`` wide), keyed by content.

    A slot holds a whole block (``block`` rows: the block's rows) or, with ``tails``, the first
    ``n < block`` rows of a block (a tail: the rows of a prefix that ends inside that block)."""

    def __init__(self, capacity: int, block: int, width: int, dtype: torch.dtype, device, tails: bool = False):
        if capacity < 1 or block < 1:
            raise ValueError("capacity and block must be >= 1")
        if block % KEY_UNIT:
            raise ValueError(f"block size {block} is not a multiple of the key unit {KEY_UNIT}")
        self.block = block
        self.capacity = capacity
        self.tails = tails
        self.pool = torch.empty(capacity, block, width, dtype=dtype, device=device)
        self._slots: OrderedDict[bytes, tuple[int, int]] = OrderedDict()   # key -> (slot, rows), LRU first
        self._free = list(range(capacity - 1, -1, -1))
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def _full_blocks(self, unit_keys: Sequence[bytes]) -> int:
        n = 0
        for key in block_keys(unit_keys, self.block):
            entry = self._slots.get(key)
            if entry is None or entry[1] != self.block:
                break
            n += 1
        return n

    def _tail(self, unit_keys: Sequence[bytes], tokens: int) -> bytes | None:
        """The key of a slot holding the rows from ``tokens``' block start to ``tokens`` (or beyond, same
        prefix)."""
        first = tokens // KEY_UNIT - 1                         # the unit ending at ``tokens``
        last = min(len(unit_keys), (tokens // self.block + 1) * (self.block // KEY_UNIT))
        need = tokens % self.block
        for j in range(first, last):                           # a longer tail of the same prefix serves too
            entry = self._slots.get(unit_keys[j])
            if entry is not None and entry[1] >= need:
                return unit_keys[j]
        return None

    def present(self, unit_keys: Sequence[bytes]) -> int:
        """Leading tokens of the keyed prefix (``unit_keys``: one key per :data:`KEY_UNIT` tokens) whose
        rows are here: whole blocks, then the longest tail inside the next block."""
        full = self._full_blocks(unit_keys)
        tokens = full * self.block
        if self.tails:
            per = self.block // KEY_UNIT
            for j in range(min(len(unit_keys), (full + 1) * per - 1) - 1, full * per - 1, -1):
                entry = self._slots.get(unit_keys[j])
                if entry is not None and entry[1] == (j + 1) * KEY_UNIT - tokens:
                    return (j + 1) * KEY_UNIT
        return tokens

    def read(self, unit_keys: Sequence[bytes], tokens: int) -> torch.Tensor | None:
        """Rows of positions ``[0, tokens)`` of the keyed prefix as one ``[tokens, width]`` tensor; ``None``
        if any of them is missing (never a partial or stale answer)."""
        full, rem = divmod(tokens, self.block)
        keys = block_keys(unit_keys, self.block)[:full]
        entries = [self._slots.get(key) for key in keys]
        tail = self._tail(unit_keys, tokens) if rem else None
        if len(keys) < full or any(e is None or e[1] != self.block for e in entries) or (rem and tail is None):
            self.stats.missing_reads += 1
            return None
        for key in keys + ([tail] if rem else []):               # read: now the most recently used
            self._slots.move_to_end(key)
        self.stats.read_blocks += full + bool(rem)
        width = self.pool.shape[-1]
        rows = self.pool.new_empty((0, width))
        if full:
            index = torch.tensor([e[0] for e in entries], dtype=torch.long)
            if self.pool.device.type != "cpu":
                index = index.pin_memory().to(self.pool.device, non_blocking=True)
            rows = self.pool.index_select(0, index).view(-1, width)
        if rem:
            rows = torch.cat([rows, self.pool[self._slots[tail][0], :rem]])
        return rows

    def write(self, key: bytes, rows: torch.Tensor) -> None:
        """Store one block's rows (``[block, width]``), or a tail's (fewer rows), unless the key is present."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return
        n = rows.shape[0]
        if not 0 < n <= self.block or (n < self.block and not self.tails):
            raise ValueError(f"a block has {self.block} rows{' (a tail fewer)' if self.tails else ''}, got {n}")
        if self._free:
            slot = self._free.pop()
        else:
            _, (slot, _) = self._slots.popitem(last=False)
            self.stats.evicted_blocks += 1
        self.pool[slot, :n].copy_(rows, non_blocking=True)
        self._slots[key] = (slot, n)
        self.stats.stored_blocks += 1

    def describe(self) -> dict:
        s = self.stats
        return {"capacity_blocks": self.capacity, "block_tokens": self.block, "tails": self.tails,
                "blocks": len(self._slots), "bytes": self.nbytes, "stored_blocks": s.stored_blocks,
                "read_blocks": s.read_blocks, "evicted_blocks": s.evicted_blocks, "missing_reads": s.missing_reads,
                "hits": s.hits, "reused_tokens": s.reused_tokens}


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

"""A thread-safe least-recently-used store bounded by the summed size of its values (and optionally their
count), with hit, miss and eviction counters: the encoder's piece caches and the reference backend's kept
states. No torch, no vLLM."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable


class SizedLRU:
    """Values by key; :meth:`put` says each value's size, and the least recently used go first once the sizes
    pass ``capacity`` or the values pass ``max_items``. A value larger than ``capacity`` is not kept."""

    def __init__(self, capacity: int, max_items: int | None = None):
        self.capacity = capacity
        self.max_items = max_items
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evicted = 0

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            got = self._items.get(key)
            if got is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return got[0]

    def put(self, key: Hashable, value: Any, size: int) -> bool:
        """Keep ``value``; ``False`` when it is not kept (larger than ``capacity``, or no items allowed)."""
        if size > self.capacity or (self.max_items is not None and self.max_items < 1):
            return False
        with self._lock:
            old = self._items.pop(key, None)
            self._size += size - (old[1] if old is not None else 0)
            self._items[key] = (value, size)
            while self._size > self.capacity or (self.max_items is not None and len(self._items) > self.max_items):
                self._size -= self._items.popitem(last=False)[1][1]
                self.evicted += 1
        return True

    @property
    def size(self) -> int:
        """The summed sizes of the values held."""
        return self._size

    def __len__(self) -> int:
        return len(self._items)

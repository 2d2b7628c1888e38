"""LRU and FIFO eviction orders (torch-free, worker process)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from lmi_cache.eviction.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Least recently used first; O(1) per operation."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """Oldest insertion first: reads do not refresh an entry."""

    def on_access(self, key: Hashable) -> None:
        return None

"""Eviction policies for the byte-bounded tiers, chosen by ``cache_policy`` (torch-free, worker process)."""
from __future__ import annotations

from lmi_cache.eviction.base import EvictionPolicy
from lmi_cache.eviction.lru import FIFOPolicy, LRUPolicy

__all__ = ["EvictionPolicy", "make_policy"]

_POLICIES: dict[str, type[EvictionPolicy]] = {"LRU": LRUPolicy, "FIFO": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by config name (``cache_policy``); KeyError names the choices."""
    try:
        return _POLICIES[name.upper()]()
    except KeyError:
        raise KeyError(f"unknown eviction policy {name!r}; choose one of {', '.join(_POLICIES)}") from None

"""The EvictionPolicy interface and its lazy registry (torch-free, worker process).

A policy only orders keys; the tier owns the bytes and decides which
candidates it can actually drop (pinned entries are skipped). Tiers call the
policy under their own lock, so policies need no locking of their own.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Hashable, Iterator

# name -> "module:Class"; imported on first use.
_POLICIES: dict[str, str] = {
    "LRU": "lmi_cache.eviction.lru:LRUPolicy",
    "FIFO": "lmi_cache.eviction.lru:FIFOPolicy",
}


class EvictionPolicy(ABC):
    """Keeps the eviction order of the keys a tier holds."""

    @abstractmethod
    def on_insert(self, key: Hashable) -> None:
        """A new key entered the tier."""

    @abstractmethod
    def on_access(self, key: Hashable) -> None:
        """A key was read (or stored again)."""

    @abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """A key left the tier (evicted, deleted or invalid); unknown keys are ignored."""

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Keys in the order they should be evicted, first victim first.

        The tier must not change the policy while iterating: collect victims, then remove.
        """

    @abstractmethod
    def __len__(self) -> int: ...


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by config name (``cache_policy``); KeyError names the choices."""
    try:
        target = _POLICIES[name.upper()]
    except KeyError:
        raise KeyError(f"unknown eviction policy {name!r}; choose one of {', '.join(_POLICIES)}") from None
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    policy: EvictionPolicy = cls()
    return policy

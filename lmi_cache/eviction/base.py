"""The EvictionPolicy interface (torch-free, worker process).

A policy only orders keys; the tier owns the bytes and decides which
candidates it can actually drop (pinned entries are skipped). Tiers call the
policy under their own lock, so policies need no locking of their own.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Iterator

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

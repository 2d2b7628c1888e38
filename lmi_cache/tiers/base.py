"""The Tier interface every storage tier implements (torch-free, worker process).

A tier stores chunk objects (``chunk_format``: header + payload) under their
16-byte digest, within a byte budget. Tier methods never raise for faults of
their medium: a fault is a miss (or a refused store), a rate-limited warning
and a metric. Callbacks (``on_remove``) are always made without the tier's
lock held, so the engine may query other tiers from them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

# Called with a digest that left the tier (evicted, damaged, failed write).
RemoveCallback = Callable[[bytes], None]


class Tier(ABC):
    """A byte-bounded store of chunk objects keyed by digest."""

    name: str = "tier"

    @abstractmethod
    def contains(self, digest: bytes) -> bool:
        """Whether a load of ``digest`` can be attempted (cheap, no I/O)."""

    @abstractmethod
    def remove(self, digest: bytes) -> bool:
        """Drop one entry; True if it was there."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every entry (and, for persistent tiers, its file)."""

    @abstractmethod
    def digests(self) -> list[bytes]:
        """Digests held now (a snapshot)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    def close(self) -> None:
        """Release threads and handles; the tier is unusable afterwards."""
        return None

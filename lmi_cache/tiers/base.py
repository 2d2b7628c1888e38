"""The Tier protocol: what the engine asks of every storage tier (worker process).

The engine walks an ordered list of tiers (fastest first: CPU RAM, disk,
remote) through these verbs only, so a new tier is a new module plus a line
in ``tiers.factory``, never a branch in the engine:

- ``contains(digest)``: can a load of it be attempted, answered from memory
  (no I/O). A tier that cannot answer without I/O (``local = False``: the
  remote store) says False; the scheduler asks such stores itself.
- ``get_many(keys)``: the chunks it holds among ``keys``, verified, as
  batches of ``(position in keys, ChunkObject)`` yielded as they become ready
  (a memory tier yields one batch at once; the disk tier one per finished
  read; the remote tier one per batched round trip). Each yielded object
  carries a reference the caller must ``release``. Keys not yielded are misses.
- ``put(obj)``: keep the chunk object at the place the placement directory
  reserved for it. The tier takes its own reference (``obj.acquire``) when it
  keeps or reads the buffer later, and never blocks on I/O: queued work that
  cannot be queued is dropped and counted. True if the tier holds or will
  hold it. A local tier has no eviction policy: a put that does not fit is
  refused (the safety net, ``CacheMetrics.safety_net``), never met by evicting.
- ``remove``, ``clear``, ``digests``, ``used_bytes``, ``capacity_bytes``,
  ``flush``, ``stats``, ``close``: housekeeping.

Flags the engine reads: ``local`` (above), ``promote_hits`` (hits in tiers
behind this one are put here when the directory says so: the CPU tier),
``holds_host_buffers`` (the tier
keeps the allocator's buffers themselves, so its unused budget is host memory
the allocator may keep warm: the CPU tier).

Tier methods never raise for faults of their medium: a fault is a miss (or a
refused put), a rate-limited warning and a metric. Callbacks (``on_drop``)
are made without the tier's locks held, so the engine may query other tiers
from them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterator, Sequence

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.tiers.host_memory import ChunkObject

# Called with a digest the tier lost on its own (damaged, unreadable, a failed write): "dropped".
DropCallback = Callable[[bytes], None]
# A batch of hits: (position in the keys asked for, the chunk with a reference for the caller).
HitBatch = list[tuple[int, ChunkObject]]


class Tier(ABC):
    """A store of chunk objects keyed by digest (what it holds is the placement directory's decision)."""

    name: str = "tier"
    local: bool = True
    promote_hits: bool = False
    holds_host_buffers: bool = False

    @abstractmethod
    def contains(self, digest: bytes) -> bool:
        """Whether a load of ``digest`` can be attempted (cheap, no I/O)."""

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self.contains(key.digest) for key in keys]

    @abstractmethod
    def get_many(self, keys: Sequence[ChunkKey]) -> Iterator[HitBatch]:
        """Verified hits among ``keys`` as batches, each object with a reference for the caller."""

    def get_many_from(self, keys: Sequence[ChunkKey], sources: Sequence[str]) -> Iterator[HitBatch]:
        """``get_many`` with the placement directory's source of each key (the peer tier reads from the peer
        a source names); other tiers need only the keys."""
        return self.get_many(keys)

    @abstractmethod
    def put(self, obj: ChunkObject) -> bool:
        """Keep ``obj`` (taking a reference if the buffer is used later); never blocks on I/O."""

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

    def peek(self, digest: bytes) -> ChunkObject | None:
        """The held object itself with a reference for the caller (a tier of host buffers), else None."""
        return None

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for queued work; False on timeout."""
        return True

    def stats(self) -> dict[str, int | float]:
        """Numbers for ``CacheEngine.stats`` (names prefixed by the tier's name)."""
        return {
            f"{self.name}_entries": len(self.digests()),
            f"{self.name}_used_bytes": self.used_bytes,
            f"{self.name}_capacity_bytes": self.capacity_bytes,
        }

    def close(self) -> None:
        """Release threads and handles; the tier is unusable afterwards."""
        return None


class RemoteHeldTier(Tier):
    """A tier whose chunks live on another machine (the shared store, a peer): this process holds, lists,
    removes and budgets nothing of it, and whether it holds a chunk takes a round trip (``local = False``)."""

    local = False

    def contains(self, digest: bytes) -> bool:
        return False

    def remove(self, digest: bytes) -> bool:
        return False

    def clear(self) -> None:
        return None

    def digests(self) -> list[bytes]:
        return []

    @property
    def used_bytes(self) -> int:
        return 0

    @property
    def capacity_bytes(self) -> int:
        return 0

"""One byte budget of a tier's page in the placement directory: entries in eviction order (scheduler process).

A ``TierBook`` keeps one budget per rank (and per disk directory of each
rank). A budget admits an entry by evicting, in its policy's order, entries
that are neither pinned by the step being planned nor leased; when what is
left cannot make room, nothing changes and the entry is not admitted. Its
room is the configured size, or what the medium has room for when that is
less (``limit_bytes``: a filling filesystem).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from lmi_cache.eviction import EvictionPolicy

# An entry evicted to make room: its digest and payload bytes.
Victim = tuple[bytes, int]


@dataclass
class _Entry:
    ready: bool  # False while its store is planned but not confirmed
    size_bytes: int  # what it takes of the budget
    payload_bytes: int  # what it holds (a demotion reserves this much in the next tier)


class Budget:
    """One byte budget: entries (ready flag, bytes) in the policy's order; pinned digests are never victims."""

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy, pinned: set[bytes],
                 leased: dict[bytes, int]) -> None:
        self.capacity_bytes = capacity_bytes
        self.limit_bytes: int | None = None  # what the medium has room for now, when less (a filling filesystem)
        self.used_bytes = 0  # ready and pending entries
        self.ready_bytes = 0
        self.evicted_pending: list[bytes] = []  # victims whose store was not confirmed yet (the book takes them)
        self.policy = policy
        self.entries: dict[bytes, _Entry] = {}
        self._pinned = pinned
        self._leased = leased

    def size_of(self, digest: object) -> int | None:
        entry = self.entries.get(cast(bytes, digest))
        return None if entry is None else entry.size_bytes

    @property
    def room_bytes(self) -> int:
        """The size entries may take: the configured one, or the medium's room when that is less."""
        return self.capacity_bytes if self.limit_bytes is None else min(self.capacity_bytes, self.limit_bytes)

    def admit(self, digest: bytes, size_bytes: int, payload_bytes: int, ready: bool) -> list[Victim] | None:
        """Add an entry, evicting what it needs; the victims, or None when it cannot fit (nothing changes)."""
        if size_bytes > self.room_bytes:
            return None
        victims, need = self._victims(self.used_bytes + size_bytes - self.room_bytes)
        if need > 0:
            return None  # what is left is pinned by this step's loads and stores
        self._evict(victims)
        self.entries[digest] = _Entry(ready, size_bytes, payload_bytes)
        self.used_bytes += size_bytes
        self.ready_bytes += size_bytes if ready else 0
        self.policy.on_insert(digest)
        return victims

    def shrink(self) -> list[Victim]:
        """Evict in the policy's order until the entries fit ``room_bytes`` (pinned ones stay, over it if need be)."""
        victims, _ = self._victims(self.used_bytes - self.room_bytes)
        self._evict(victims)
        return victims

    def _evict(self, victims: list[Victim]) -> None:
        for victim, _ in victims:
            if not self.entries[victim].ready:
                self.evicted_pending.append(victim)
            self.forget(victim)

    def _victims(self, need: int) -> tuple[list[Victim], int]:
        """Unpinned entries in eviction order freeing ``need`` bytes, and the bytes still needed (> 0: too few)."""
        victims: list[Victim] = []
        for candidate in self.policy.candidates():  # collect first: the policy must not change mid-iteration
            if need <= 0:
                break
            if candidate in self._pinned or candidate in self._leased:
                continue
            entry = self.entries[cast(bytes, candidate)]
            victims.append((cast(bytes, candidate), entry.payload_bytes))
            need -= entry.size_bytes
        return victims, need

    def confirm(self, digest: bytes) -> None:
        entry = self.entries[digest]
        if not entry.ready:
            entry.ready = True
            self.ready_bytes += entry.size_bytes

    def forget(self, digest: bytes) -> None:
        entry = self.entries.pop(digest)
        self.used_bytes -= entry.size_bytes
        self.ready_bytes -= entry.size_bytes if entry.ready else 0
        self.policy.on_remove(digest)

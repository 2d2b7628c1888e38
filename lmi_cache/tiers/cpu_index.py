"""The CPU tier's index and byte budget (torch-free; worker process).

Shaped like the disk tier's ``DiskIndex``: digest -> entry and size, a byte
budget, an eviction policy. It never touches memory: the tier hands it
whatever it keeps per entry (a ``ChunkObject``) and gets the evicted ones
back to release. One lock guards the map, the budget and the policy.
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, Iterator, TypeVar, cast

from lmi_cache.eviction.base import EvictionPolicy

E = TypeVar("E")


class Refused(Exception):
    """An entry larger than the whole budget."""


class CpuIndex(Generic[E]):
    def __init__(self, capacity_bytes: int, policy: EvictionPolicy) -> None:
        self._capacity_bytes = capacity_bytes
        self._policy = policy
        self._lock = threading.Lock()
        self._entries: dict[bytes, tuple[E, int]] = {}
        self._used_bytes = 0

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def digests(self) -> list[bytes]:
        with self._lock:
            return list(self._entries)

    def get(self, digest: bytes, claim: Callable[[E], object] | None = None) -> E | None:
        """The entry, marked used, or None; ``claim(entry)`` runs under the lock (take a reference
        there: once the lock is released, an eviction may drop the index's own)."""
        with self._lock:
            found = self._entries.get(digest)
            if found is None:
                return None
            self._policy.on_access(digest)
            if claim is not None:
                claim(found[0])
            return found[0]

    def admit(self, digest: bytes, entry: E, size_bytes: int) -> tuple[E | None, list[E]]:
        """Add ``entry``; returns (the entry already present or None, entries evicted to make room).

        Raises ``Refused`` when ``size_bytes`` exceeds the whole budget.
        """
        if size_bytes > self._capacity_bytes:
            raise Refused
        with self._lock:
            found = self._entries.get(digest)
            if found is not None:
                self._policy.on_access(digest)
                return found[0], []
            need = self._used_bytes + size_bytes - self._capacity_bytes
            victims: list[bytes] = []
            for digest_out in self._candidates():  # collect first: the policy must not change mid-iteration
                if need <= 0:
                    break
                victims.append(digest_out)
                need -= self._entries[digest_out][1]
            evicted = [self._pop_locked(victim) for victim in victims]
            self._entries[digest] = (entry, size_bytes)
            self._used_bytes += size_bytes
            self._policy.on_insert(digest)
            return None, evicted

    def entry_bytes(self, digest: bytes) -> int | None:
        """Budget bytes of an entry (None: absent). Takes no lock: policies call it under the index's."""
        found = self._entries.get(digest)
        return None if found is None else found[1]

    def under_lock(self, action: Callable[[], None]) -> None:
        """Run ``action`` (a change of the policy's order: session retention) under the index's lock."""
        with self._lock:
            action()

    def _candidates(self) -> Iterator[bytes]:
        """Digests in eviction order (called under the lock; the place to prefer some entries over others)."""
        for digest in self._policy.candidates():
            yield cast(bytes, digest)

    def forget(self, digest: bytes) -> E | None:
        with self._lock:
            if digest not in self._entries:
                return None
            return self._pop_locked(digest)

    def clear(self) -> list[E]:
        with self._lock:
            entries = [entry for entry, _ in self._entries.values()]
            for digest in list(self._entries):
                self._policy.on_remove(digest)
            self._entries.clear()
            self._used_bytes = 0
            return entries

    def _pop_locked(self, digest: bytes) -> E:
        entry, size = self._entries.pop(digest)
        self._used_bytes -= size
        self._policy.on_remove(digest)
        return entry

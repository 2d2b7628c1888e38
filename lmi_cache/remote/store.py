"""The byte-level remote store interface and the backoff gate in front of it (vLLM worker process).

A ``RemoteStore`` is the bottom of the remote path: it speaks value bytes by
name (a string such as ``<prefix>:v1:<digest hex>``, from ``name_for``), with
batched verbs shaped like the data path, one call per batch and one network
round trip where the store allows it: ``exists_many``, ``fetch_many`` /
``fetch_many_into`` and ``upload_many``. It knows nothing of chunks, codecs or
timeouts beyond its sockets'. Stores raise ``StoreError`` for every fault
(connection, timeout, server error) with a message that never holds
credentials; the ``RemoteCache`` above turns those into misses. ``Backoff``
keeps a store that just failed from being asked again until a growing,
jittered delay passes.
"""
from __future__ import annotations

import random
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from lmi_cache.remote.value_codec import KEY_VERSION


class StoreError(Exception):
    """A store call failed (the message is safe to log: no credentials)."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


# Memory for a value's body: (owner, writable view of at least the size asked), or None when short.
BodyAllocator = Callable[[int], "tuple[Any, memoryview] | None"]


@dataclass
class ReceivedValue:
    """One value read into memory: its first bytes, and the rest in memory from the allocator."""

    head: bytes  # the first ``split_at`` bytes (the whole value when it is shorter)
    body: memoryview  # the bytes after them (empty when there are none)
    owner: Any  # what the allocator returned for ``body``; None when it had none to give


class RemoteStore(ABC):
    """Batched name -> bytes store. Implementations are thread-safe."""

    name: str = "remote"

    def __init__(self, key_prefix: str) -> None:
        self.key_prefix = key_prefix

    def name_for(self, digest: bytes) -> str:
        """Name of a chunk digest's value: fixed prefix and value-format version, then the digest's hex."""
        return f"{self.key_prefix}:{KEY_VERSION}:{digest.hex()}"

    @abstractmethod
    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Which names hold a value (one round trip for the batch)."""

    @abstractmethod
    def fetch_many(self, names: Sequence[str]) -> list[bytes | None]:
        """The values under the names, None where absent (one round trip for the batch)."""

    def fetch_many_into(
        self, names: Sequence[str], split_at: int, allocate: BodyAllocator
    ) -> list[ReceivedValue | None]:
        """``fetch_many``, each value's bytes after ``split_at`` in memory from ``allocate``.

        This default copies each value once; a store that can receive straight into the
        allocator's memory (Redis) overrides it.
        """
        return [None if value is None else split_value(value, split_at, allocate) for value in self.fetch_many(names)]

    @abstractmethod
    def upload_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store every (name, value) (one round trip for the batch)."""

    @abstractmethod
    def ping(self) -> None:
        """One cheap request; StoreError when the store does not answer."""

    def warm_up(self) -> None:
        """Open connections (and, for a cluster, learn its topology) before the first lookup needs them."""
        self.ping()

    def close(self) -> None:
        return None


class Backoff:
    """Open after a failure for a delay that doubles up to a cap (with jitter); closed by a success."""

    def __init__(self, initial_s: float = 0.5, max_s: float = 30.0) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._delay_s = 0.0
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self.failures = 0  # consecutive
        self.reconnects = 0  # recoveries after a failure

    def allow(self) -> bool:
        """Whether a call may go to the store now; while it is down, one caller per delay gets to probe it."""
        with self._lock:
            now = time.monotonic()
            if now < self._retry_at:
                return False
            if self.failures:
                self._retry_at = now + self._delay_s  # the probe's outcome decides what comes next
            return True

    @property
    def is_down(self) -> bool:
        with self._lock:
            return self.failures > 0

    def failed(self) -> bool:
        """Record a failure; True when the store was up before (the caller warns once per outage)."""
        with self._lock:
            was_up = self.failures == 0
            self.failures += 1
            self._delay_s = self._initial_s if was_up else min(self._max_s, self._delay_s * 2)
            self._retry_at = time.monotonic() + self._delay_s * random.uniform(0.8, 1.2)
            return was_up

    def succeeded(self) -> bool:
        """Record a success; True when it ends an outage."""
        with self._lock:
            recovered = self.failures > 0
            if recovered:
                self.reconnects += 1
            self.failures = 0
            self._delay_s = 0.0
            self._retry_at = 0.0
            return recovered


def split_value(value: bytes | memoryview, split_at: int, allocate: BodyAllocator) -> ReceivedValue:
    """A value already in memory as a ReceivedValue: its head, and one copy of the rest into ``allocate``'s memory."""
    view = memoryview(value)
    rest = view[split_at:]
    if not len(rest):
        return ReceivedValue(bytes(view), memoryview(b""), None)
    given = allocate(len(rest))
    if given is None:
        return ReceivedValue(bytes(view[:split_at]), rest, None)
    owner, body = given[0], given[1][: len(rest)]
    body[:] = rest
    return ReceivedValue(bytes(view[:split_at]), body, owner)

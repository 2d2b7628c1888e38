"""The remote store as the placement directory sees it: asked, never mirrored (vLLM scheduler process).

The store is shared by a fleet and evicts on its own, so a copy of its
contents here would go stale: a lookup beyond the local tiers sends one
batched, asynchronous existence check through the store's client (``ask``),
and a new chunk is written there unless this server wrote it lately
(``admit_write``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.placement.recent_digests import RecentDigests

if TYPE_CHECKING:
    from lmi_cache.remote.cache import PendingLookup

# These many digests written to the store lately are not written again (a shared prefix of concurrent
# requests). Beyond that a rewrite only costs a redundant put.
REMOTE_RECENT_DIGESTS = 65536


class RemoteLookups(Protocol):
    """The remote store's existence checks (``lmi_cache.remote.cache.RemoteCache``)."""

    def has_many_async(self, keys: Sequence[ChunkKey]) -> PendingLookup: ...


class RemoteAsks:
    """The directory's questions to the remote store, and its memory of what it wrote there lately."""

    def __init__(self, lookups: RemoteLookups, writes: bool) -> None:
        self.lookups = lookups
        self._writes = writes
        self._recent = RecentDigests(REMOTE_RECENT_DIGESTS)

    def ask(self, keys: Sequence[ChunkKey]) -> PendingLookup:
        """One batched, asynchronous existence check (``poll()`` answers)."""
        return self.lookups.has_many_async(list(keys))

    def admit_write(self, digests: Sequence[bytes]) -> bool:
        """Whether a new chunk goes to the store: writes are on, and this server did not write it lately."""
        return self._writes and self._recent.admit(digests)

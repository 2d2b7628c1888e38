"""The evictions the placement directory decides, on their way to the workers (vLLM scheduler process).

Every entry that leaves a local tier by the directory's decision passes
through here: it is queued for the rank whose tier holds it (the step's
metadata carries it, ``take``), counted
(``lmi_cache_placement_evictions_total``), announced in the KV events
(removed; a demotion is stored in the next tier before it is removed from the
first) and remembered a while, so a later miss on it is counted as an
eviction's, not as a chunk never stored (``was_lost``). A victim of the first
tier is demoted to the disk tier when ``disk_feed: demote`` and the disk tier
has room: the only demotion there is.
"""
from __future__ import annotations

from collections.abc import Sequence

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.scheduler_series import SchedulerMetrics
from lmi_cache.placement.book import TierBook
from lmi_cache.placement.budget import Victim
from lmi_cache.placement.events import TierEventLog
from lmi_cache.placement.messages import Eviction
from lmi_cache.placement.recent_digests import RecentDigests

# Entries evicted or lost lately, remembered (this many) to say why a request missed them.
LOST_RECENT_DIGESTS = 65536


class EvictionOutbox:
    """The directory's evictions and demotions, queued by rank; see the module docstring."""

    def __init__(self, metrics: SchedulerMetrics, demotion: tuple[TierBook, TierBook] | None = None) -> None:
        self.metrics = metrics
        self._demotion = demotion  # (the first tier, the tier its victims go to), or None
        self._queued: list[Eviction] = []
        self._lost = RecentDigests(LOST_RECENT_DIGESTS)
        self.events: TierEventLog | None = None  # KV events of the local tiers, when routers listen

    def evicted(self, book: TierBook, rank: int, victims: list[Victim], demote: bool = True) -> None:
        """``victims`` left ``book`` on ``rank`` (room made, or over a budget); demoted where the setup says so."""
        target = self._demotion[1] if demote and self._demotion is not None and book is self._demotion[0] else None
        if victims:
            self.metrics.evicted(book.name, len(victims))
        for digest, payload_bytes in victims:
            if target is not None and not target.knows(digest):
                more = target.reserve(rank, digest, payload_bytes)
                if more is not None:
                    self._lost.admit([digest])
                    if self.events is not None:
                        self.events.on_demoting(book.name, target.name, digest)
                    self.evicted(target, rank, more)
                    self._queued.append(Eviction(rank, book.name, digest, target.name))
                    continue
            self._queued.append(Eviction(rank, book.name, digest))
            self.gone(book.name, digest)

    def gone(self, tier: str, digest: bytes) -> None:
        """An entry left ``tier`` (evicted, or a store that did not land)."""
        self._lost.admit([digest])
        if self.events is not None:
            self.events.on_gone(tier, digest)

    def remove_again(self, rank: int, tier: str, digest: bytes) -> None:
        """Have ``rank`` remove an entry its tier holds and the directory does not."""
        self._queued.append(Eviction(rank, tier, digest))

    def was_lost(self, keys: Sequence[ChunkKey]) -> bool:
        """Some rank's entry of the chunk was evicted or lost lately (a miss on it is an eviction's)."""
        return any(key.digest in self._lost for key in keys)

    def take(self) -> dict[int, list[Eviction]]:
        """The evictions queued since the last call, by the rank whose tier they concern."""
        by_rank: dict[int, list[Eviction]] = {}
        for eviction in self._queued:
            by_rank.setdefault(eviction.rank, []).append(eviction)
        self._queued = []
        return by_rank

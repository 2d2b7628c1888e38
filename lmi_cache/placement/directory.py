"""The placement directory: the one owner of what is cached where (vLLM scheduler process).

Shaped like vLLM's ``kv_offload`` manager. The scheduler side asks it
(``lookup``, ``ask_remote``), plans each step's loads and stores with it
(``prepare_load``, ``prepare_store``, ``prepare_receive``, ``lease``), hands
it what the workers report (``complete``) and takes its decisions into the
step's metadata (``take_evictions``, ``end_step``); the workers only carry
out what it decided. Each method states its contract; docs/architecture.md
("One owner of placement") draws them together.

The remote store is asked, not mirrored (``placement.remote_asks``): it is
shared by a fleet and evicts on its own.

This is the only budget-and-evict implementation. Budgets are per rank (every
rank's tiers have the configured sizes) and use each tier's own rounding
(``tiers.entry_sizes``, which the tiers use too), so a worker's tier never
evicts: it holds what it is told and, if its medium disagrees (a damaged
file, a full filesystem), reports the entry dropped and the directory forgets
it. A worker that cannot serve a planned load makes vLLM recompute, so a
stale entry costs time, never correctness.

Sizes: an entry's payload is what its rank's worker reported for its KV
cache group (``sizes``, ``placement.chunk_sizes``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.scheduler_series import SchedulerMetrics
from lmi_cache.placement.book import TierBook, TierSpec
from lmi_cache.placement.chunk_sizes import ChunkSizes
from lmi_cache.placement.events import JOURNALED_TIER, ChunkBlocks, TierChange, TierEventLog
from lmi_cache.placement.evictions import EvictionOutbox
from lmi_cache.placement.messages import REMOTE, Eviction, TierEvent
from lmi_cache.placement.remote_asks import RemoteAsks, RemoteLookups

if TYPE_CHECKING:
    from lmi_cache.placement.disk_space import DiskSpaceWatch
    from lmi_cache.placement.event_journal import EventJournal
    from lmi_cache.remote.cache import PendingLookup

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class LoadSource:
    tier: str  # where the workers read the chunk
    promote: bool = False  # and put it into the first tier (the directory made room)


# What a chunk's KV events say (vLLM's block hashes and tokens of the blocks it covers), asked only when needed.
Describe = Callable[[], ChunkBlocks | None]


class PlacementDirectory:
    """See the module docstring. ``tiers``: local tiers, fastest first (the CPU tier, then the disk tier)."""

    def __init__(self, tiers: Sequence[TierSpec], *, chunk_tokens: int, write_through: Iterable[str] = (),
                 demote_to: str | None = None, remote: RemoteLookups | None = None, remote_writes: bool = False,
                 metrics: SchedulerMetrics | None = None) -> None:
        self.books = [TierBook(spec) for spec in tiers if spec.capacity_bytes > 0]
        self._by_name = {book.name: book for book in self.books}
        self._write_through = {name for name in write_through if name in self._by_name}
        self.chunk_tokens = chunk_tokens
        self.remote = RemoteAsks(remote, remote_writes) if remote is not None else None
        self.sizes = ChunkSizes(chunk_tokens)
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        target = self._by_name.get(demote_to or "")
        first = self.books[0] if self.books else None
        # No demotion when the disk tier is the first tier itself (the CPU tier is off).
        demotion = (first, target) if first is not None and target is not None and target is not first else None
        self._outbox = EvictionOutbox(self.metrics, demotion)
        self._space: tuple[TierBook, DiskSpaceWatch] | None = None  # a tier planned against its filesystem too

    @property
    def events(self) -> TierEventLog | None:
        """KV events of the local tiers, when routers listen (``enable_events``)."""
        return self._outbox.events

    def enable_events(self, journal: EventJournal | None = None) -> None:
        """Keep what each chunk's KV events say and publish every change of the local tiers (``take_events``).
        With a ``journal``, the disk files adopted at start that it describes are announced now."""
        if self.events is not None:
            return
        events = self._outbox.events = TierEventLog(lambda tier, digest: self._by_name[tier].holds(digest),
                                                    lambda digest: any(book.knows(digest) for book in self.books),
                                                    [book.name for book in self.books])
        if journal is not None and JOURNALED_TIER in self._by_name:
            events.adopt_journal(journal)

    def take_events(self) -> list[TierChange]:
        return self.events.take() if self.events is not None else []

    def _describe(self, keys: Sequence[ChunkKey], describe: Describe | None) -> None:
        if self.events is not None and describe is not None:
            digests = [key.digest for key in keys]
            if not self.events.described(digests):
                self.events.describe(digests, describe())

    # -- tiers ---------------------------------------------------------------------------

    @property
    def first_tier_name(self) -> str:
        return self.books[0].name if self.books else ""

    # -- lookups -------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> str | None:
        """The first local tier holding every rank's entry of the chunk (ready), or None."""
        for book in self.books:
            if all(book.holds(key.digest) for key in keys):
                return book.name
        return None

    def holds(self, keys: Sequence[ChunkKey]) -> bool:
        return self.lookup(keys) is not None

    def ask_remote(self, keys: Sequence[ChunkKey]) -> PendingLookup:
        """One batched, asynchronous existence check in the remote store (``poll()`` answers); needs ``remote``."""
        assert self.remote is not None, "no remote store"
        return self.remote.ask(keys)

    # -- loads and stores ----------------------------------------------------------------

    def prepare_load(self, keys: Sequence[ChunkKey], group: int, source: str,
                     describe: Describe | None = None, payload_bytes: int | None = None) -> LoadSource:
        """Plan a load from ``source`` (its entries pinned for the step); promote it into the first tier when it
        comes from behind it (room is made there now).
        ``payload_bytes``: each rank's entry's size when it is not the group's chunks' (blending's objects)."""
        self._describe(keys, describe)
        digests = [key.digest for key in keys]
        book = self._by_name.get(source)
        if book is not None:
            for digest in digests:
                book.touch(digest)
            book.pin(digests)
        first = self.books[0] if self.books else None
        if first is None or source == first.name:
            return LoadSource(source)
        first.pin(digests)
        if all(first.knows(d) for d in digests):
            return LoadSource(source)  # already on its way into the first tier
        return LoadSource(source, self._reserve_all(first, keys, group, None, payload_bytes))

    def prepare_store(self, keys: Sequence[ChunkKey], group: int, num_tokens: int | None = None,
                      describe: Describe | None = None, payload_bytes: int | None = None) -> tuple[str, ...]:
        """The tiers to store a chunk into (the first local tier, every write-through tier behind it, the remote
        store; room reserved in each local one), or () when every tier holds or expects it, or nothing can fit.
        ``payload_bytes``: each rank's entry's size when it is not the group's chunks' (blending's objects)."""
        tiers: list[str] = []
        digests = [key.digest for key in keys]
        for position, book in enumerate(self.books):
            if position > 0 and book.name not in self._write_through:
                continue
            book.pin(digests)
            if all(book.knows(d) for d in digests):
                continue
            if self._reserve_all(book, keys, group, num_tokens, payload_bytes):
                tiers.append(book.name)
            # else: no room that this step does not use (or larger than a budget): not stored there
        if self.remote is not None and self.remote.admit_write(digests):
            tiers.append(REMOTE)
        self._describe(keys, describe)
        return tuple(tiers)

    def prepare_receive(self, keys: Sequence[ChunkKey], group: int, tier: str) -> bool:
        """Room in ``tier`` for a chunk another component writes there (a peer read into a CPU slot): True when
        reserved (pending, pinned this step; the writer reports it stored or failed like a store)."""
        book = self._by_name.get(tier)
        if book is None:
            return False
        digests = [key.digest for key in keys]
        book.pin(digests)
        return not all(book.knows(d) for d in digests) and self._reserve_all(book, keys, group, None)

    def lease(self, keys: Sequence[ChunkKey], tier: str) -> bool:
        """Keep every rank's entry of a held chunk in ``tier`` until ``end_lease``; False (nothing leased) when
        the tier does not hold it on every rank."""
        book = self._by_name.get(tier)
        if book is None or not all(book.holds(key.digest) for key in keys):
            return False
        for key in keys:
            book.lease(key.digest)
        return True

    def end_lease(self, keys: Sequence[ChunkKey], tier: str) -> None:
        book = self._by_name.get(tier)
        if book is not None:
            for key in keys:
                book.end_lease(key.digest)

    def _reserve_all(self, book: TierBook, keys: Sequence[ChunkKey], group: int, num_tokens: int | None,
                     payload_bytes: int | None = None) -> bool:
        """Reserve every rank's entry, or none of them (a half-reserved chunk would never be confirmed)."""
        done: list[bytes] = []
        for rank, key in enumerate(keys):
            payload = payload_bytes if payload_bytes is not None else \
                self.sizes.payload_bytes(rank, group, key.num_tokens if num_tokens is None else num_tokens)
            knew = book.knows(key.digest)
            victims = book.reserve(rank, key.digest, payload)
            if victims is None:
                for digest in done:
                    book.drop(digest)
                    self._outbox.gone(book.name, digest)
                return False
            if not knew:
                done.append(key.digest)
            self._outbox.evicted(book, rank, victims)
        return True

    def was_lost(self, keys: Sequence[ChunkKey]) -> bool:
        """Some rank's entry of the chunk was evicted or lost lately (a miss on it is an eviction's)."""
        return self._outbox.was_lost(keys)

    # -- feedback ------------------------------------------------------------------------

    def complete(self, rank: int, stored: Iterable[TierEvent] = (), failed: Iterable[TierEvent] = (),
                 dropped: Iterable[TierEvent] = ()) -> None:
        """One rank's report: stores that landed, planned ones that did not, entries its media lost. A store it
        never planned is refused, counted (a bug) and evicted from that rank again."""
        for event in stored:
            book = self._by_name.get(event.tier)
            if book is None:
                continue
            if not book.confirm(event.digest):  # not held: the worker removes it again (harmless if it has)
                if book.evicted_before_confirm(event.digest):
                    # Planned, then evicted before this report came (asynchronous scheduling plans the next step
                    # before this one reports): the eviction went out after the store, so this is no stray.
                    self.metrics.evicted_before_confirm(book.name)
                else:
                    self.metrics.unplanned_store(book.name)  # never planned: a bug
                self._outbox.remove_again(rank, book.name, event.digest)
            elif self.events is not None:
                self.events.on_ready(book.name, event.digest)
        for event in failed:  # the worker counted why (lmi_cache_dropped_stores_total)
            book = self._by_name.get(event.tier)
            if book is not None:
                book.evicted_before_confirm(event.digest)  # answered: nothing to remember
                book.drop(event.digest)
                self._outbox.gone(book.name, event.digest)
        for event in dropped:
            if event.reason and rank == 0:  # a planned load that did not land; every rank reports its own
                self.metrics.missed(event.reason, self.chunk_tokens)
            book = self._by_name.get(event.tier)
            if book is not None and book.drop(event.digest):
                self.metrics.dropped(book.name, 1)
                self._outbox.gone(book.name, event.digest)

    def watch_space(self, tier: str, watch: DiskSpaceWatch) -> None:
        """Plan ``tier`` against its filesystem's free space as well as its size (``disk_space``)."""
        book = self._by_name.get(tier)
        if book is not None:
            self._space = (book, watch)

    def _follow_space(self) -> None:
        """Cap the watched tier's budgets at its filesystem's room, evicting the oldest entries over it."""
        if self._space is None:
            return
        book, watch = self._space
        for (rank, shard), limit in (watch.limits(book.ready_bytes) or {}).items():
            self._outbox.evicted(book, rank, book.limit(rank, shard, limit))

    def take_evictions(self) -> dict[int, list[Eviction]]:
        """The evictions decided since the last call, by the rank whose tier they concern (the filesystem's room
        checked first, so its evictions go out with this step, before its writes)."""
        self._follow_space()
        return self._outbox.take()

    def end_step(self) -> None:
        """The step is planned: its pins go."""
        for book in self.books:
            book.unpin_all()
            self.metrics.placement(book.name, len(book), book.protected_bytes())

    # -- start-up and sessions -----------------------------------------------------------

    def adopt(self, tier: str, rank: int, shard: int, digest: bytes, size_bytes: int) -> None:
        """An entry a tier already holds at start-up (disk files, oldest first); entries over the budget are
        evicted (the worker deletes them with the first step)."""
        book = self._by_name.get(tier)
        if book is None:
            return
        self._outbox.evicted(book, rank, book.adopt(rank, shard, digest, size_bytes), demote=False)

    def retain_for_session(self, session: str, digests: Sequence[bytes]) -> None:
        for book in self.books:
            book.retain_for_session(session, digests)

    def end_session(self, session: str) -> None:
        for book in self.books:
            book.end_session(session)

    def digests(self) -> set[bytes]:
        """Every digest some local tier holds or expects, on any rank."""
        return set().union(*(book.digests() for book in self.books))

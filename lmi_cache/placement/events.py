"""KV events from the placement directory's decisions (vLLM scheduler process; torch-free, vLLM-free).

Routers (llm-d's precise prefix-cache scorer, Dynamo's KV router) learn what a
server holds from vLLM's KV events. vLLM publishes its GPU prefix cache; this
log says what the connector's own tiers hold, in vLLM's terms, so the
connector can hand it to vLLM's publisher (``vllm_connector.kv_events``).

The directory keys chunks by our digests (one per rank); a router knows vLLM's
block hashes. ``describe`` records, for one chunk, what vLLM's own event would
say of the vLLM blocks it covers (``ChunkBlocks``: vLLM's block hashes, the
parent hash, the token ids, block size, LoRA, extra keys, KV cache group); the
record lives while some tier holds or expects one of the chunk's digests, and
is dropped with the last one, so the log is bounded by the directory.

What is published follows the directory, chunk by chunk:

- ``StoredBlocks(medium, blocks)`` once every rank's entry of the chunk is
  ready (stored and confirmed by the workers) in a tier;
- ``RemovedBlocks(medium, hashes)`` when the first rank's entry leaves that
  tier (evicted, a failed store, a worker's medium lost it);
- a demotion (the CPU tier's victim handed to the disk tier) publishes the
  disk store first and the CPU removal after it, once the disk tier has
  confirmed it (or failed it): a router never sees the chunk in neither tier
  while it is still on its way.
- within one batch (``take``), a chunk's store in a medium comes after its
  parent chunk's store there: workers confirm a step's stores in the order they
  finish (a promotion from disk, read by several threads, can land the second
  chunk of a prompt before the first), and routers index a stored block only
  under a parent they already hold (Dynamo's rule; llm-d drops an event with an
  unknown parent), so a child announced first would never be indexed.

Mediums are vLLM's: ``CPU`` for the CPU tier, ``STORAGE`` for the disk tier.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from lmi_cache.placement.event_journal import EventJournal, Record

# vLLM's medium names (vllm.distributed.kv_events.MEDIUM_CPU / MEDIUM_STORAGE) for our local tiers.
TIER_MEDIUMS = {"cpu": "CPU", "disk": "STORAGE"}

# The tier whose chunks outlive the process (its descriptions are journaled: ``event_journal``).
JOURNALED_TIER = "disk"

BlockHash = Union[int, bytes]  # vLLM's ExternalBlockHash: an int by default, bytes when configured so


@dataclass(frozen=True)
class ChunkBlocks:
    """What vLLM's ``BlockStored`` says of the vLLM blocks one chunk covers (one entry per vLLM block)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int  # tokens per vLLM block, the engine's
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class StoredBlocks:
    medium: str
    blocks: ChunkBlocks


@dataclass(frozen=True)
class RemovedBlocks:
    medium: str
    block_hashes: tuple[BlockHash, ...]
    group_idx: int = 0


TierChange = Union[StoredBlocks, RemovedBlocks]


@dataclass
class _Chunk:
    digests: tuple[bytes, ...]  # every rank's entry
    blocks: ChunkBlocks
    published: set[str] = field(default_factory=set)  # tiers announced as holding the chunk
    in_transit: dict[bytes, str] = field(default_factory=dict)  # digest -> the tier it is being demoted to
    deferred: set[str] = field(default_factory=set)  # tiers whose removal waits for a demotion to land


class TierEventLog:
    """See the module docstring. ``holds(tier, digest)``: ready there; ``knows(digest)``: any tier holds or
    expects it (the directory's answers)."""

    def __init__(self, holds: Callable[[str, bytes], bool], knows: Callable[[bytes], bool],
                 tiers: Sequence[str]) -> None:
        self._holds = holds
        self._knows = knows
        self._tiers = [tier for tier in tiers if tier in TIER_MEDIUMS]
        self._chunks: dict[bytes, _Chunk] = {}
        self._changes: list[TierChange] = []
        self.journal: EventJournal | None = None  # keeps what the disk tier's chunks say across restarts
        self._num_published: dict[str, int] = {}  # tier -> chunks announced there now

    def adopt_journal(self, journal: EventJournal) -> None:
        """Announce the adopted disk files ``journal`` describes (oldest first: a parent before its child) and
        keep journaling the disk tier's chunks there."""
        for digests, blocks in journal.load():
            self.describe(digests, blocks)
        journal.rewrite(self.records_in(JOURNALED_TIER))
        self.journal = journal

    def records_in(self, tier: str) -> list[Record]:
        """The chunks announced in ``tier``: their digests and descriptions (each chunk once)."""
        unique = {id(chunk): chunk for chunk in self._chunks.values() if tier in chunk.published}
        return [(chunk.digests, chunk.blocks) for chunk in unique.values()]

    def __len__(self) -> int:
        """Chunks described (each once, whatever its number of ranks)."""
        return len({id(chunk) for chunk in self._chunks.values()})

    def described(self, digests: Sequence[bytes]) -> bool:
        return bool(digests) and all(d in self._chunks for d in digests)

    def describe(self, digests: Sequence[bytes], blocks: ChunkBlocks | None) -> None:
        """Record what a chunk's events say; a tier that already holds it is announced now (adopted files)."""
        if blocks is None or not digests or self.described(digests) or not any(self._knows(d) for d in digests):
            return  # nothing to say, said already, or no tier holds or expects it (the record would never go)
        chunk = _Chunk(tuple(digests), blocks)
        for digest in chunk.digests:
            self._chunks[digest] = chunk
        for tier in self._tiers:
            self._announce(chunk, tier)

    def on_ready(self, tier: str, digest: bytes) -> None:
        """A rank's entry was confirmed in ``tier``."""
        chunk = self._chunks.get(digest)
        if chunk is None:
            return
        self._announce(chunk, tier)
        if chunk.in_transit.get(digest) == tier:
            del chunk.in_transit[digest]
            self._settle(chunk)

    def on_demoting(self, source: str, target: str, digest: bytes) -> None:
        """A rank's entry leaves ``source`` for ``target``: the removal from ``source`` waits for ``target``."""
        chunk = self._chunks.get(digest)
        if chunk is None:
            return
        chunk.in_transit[digest] = target
        if source in chunk.published:
            chunk.deferred.add(source)

    def on_gone(self, tier: str, digest: bytes) -> None:
        """A rank's entry left ``tier`` (evicted, a failed store, lost by a worker's medium)."""
        chunk = self._chunks.get(digest)
        if chunk is None:
            return
        if chunk.in_transit.get(digest) == tier:  # the demotion did not land
            del chunk.in_transit[digest]
        if tier in chunk.published:
            chunk.deferred.add(tier)
        self._settle(chunk)

    def take(self) -> list[TierChange]:
        changes, self._changes = self._changes, []
        return parents_first(changes)

    # -- internals -------------------------------------------------------------------------

    def _announce(self, chunk: _Chunk, tier: str) -> None:
        medium = TIER_MEDIUMS.get(tier)
        if medium is None or tier in chunk.published:
            return
        if all(self._holds(tier, d) for d in chunk.digests):
            chunk.published.add(tier)
            chunk.deferred.discard(tier)
            self._num_published[tier] = self._num_published.get(tier, 0) + 1
            self._changes.append(StoredBlocks(medium, chunk.blocks))
            if self.journal is not None and tier == JOURNALED_TIER:
                self.journal.append(chunk.digests, chunk.blocks)
                if self.journal.needs_rewrite(self._num_published[tier]):
                    self.journal.rewrite(self.records_in(JOURNALED_TIER))

    def _settle(self, chunk: _Chunk) -> None:
        """Publish the removals no demotion holds back any more; forget a chunk no tier knows."""
        if chunk.in_transit:
            return
        for tier in sorted(chunk.deferred):
            if all(self._holds(tier, d) for d in chunk.digests):
                continue  # stored there again meanwhile: still held
            chunk.published.discard(tier)
            self._num_published[tier] -= 1
            self._changes.append(RemovedBlocks(TIER_MEDIUMS[tier], chunk.blocks.block_hashes, chunk.blocks.group_idx))
        chunk.deferred.clear()
        if not any(self._knows(d) for d in chunk.digests):
            for digest in chunk.digests:
                if self._chunks.get(digest) is chunk:
                    del self._chunks[digest]


def _hashes(change: TierChange) -> tuple[BlockHash, ...]:
    return change.blocks.block_hashes if isinstance(change, StoredBlocks) else change.block_hashes


def _group(change: TierChange) -> int:
    return change.blocks.group_idx if isinstance(change, StoredBlocks) else change.group_idx


def parents_first(changes: list[TierChange]) -> list[TierChange]:
    """``changes`` with each chunk's store moved to just after its parent chunk's store in the same medium and
    group, when that comes later in the batch (or moved there itself); later changes of a moved chunk move with
    it. Everything else keeps its order."""
    stored_at = {(c.medium, c.blocks.group_idx, c.blocks.block_hashes[-1]): i
                 for i, c in enumerate(changes) if isinstance(c, StoredBlocks) and c.blocks.block_hashes}
    waiting: dict[int, list[int]] = {}  # index -> the changes that go right after it
    moved: dict[tuple[str, int, BlockHash], int] = {}  # a moved chunk's blocks -> its store's index
    out: list[TierChange] = []
    done: set[int] = set()

    def emit(index: int) -> None:  # and what waits for it, depth first (a long prompt's chain: no recursion)
        stack = [index]
        while stack:
            current = stack.pop()
            out.append(changes[current])
            done.add(current)
            stack.extend(reversed(waiting.pop(current, [])))

    for index, change in enumerate(changes):
        after = None
        if isinstance(change, StoredBlocks) and change.blocks.parent_block_hash is not None:
            parent = stored_at.get((change.medium, change.blocks.group_idx, change.blocks.parent_block_hash))
            if parent is not None and parent not in done:  # later in the batch, or itself moved behind its parent
                after = parent
        if after is None:  # a later change of a chunk whose store moved goes after that store
            stores = (moved.get((change.medium, _group(change), block)) for block in _hashes(change))
            after = next((store for store in stores if store is not None and store not in done), None)
        if after is None:
            emit(index)
            continue
        waiting.setdefault(after, []).append(index)
        if isinstance(change, StoredBlocks):
            for block in change.blocks.block_hashes:
                moved[(change.medium, change.blocks.group_idx, block)] = index
    for index in sorted(i for held in waiting.values() for i in held if i not in done):
        if index not in done:  # unreachable with well-formed batches; never lose a change
            emit(index)
    return out

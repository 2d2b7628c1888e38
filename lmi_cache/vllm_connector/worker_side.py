"""Worker half of LmiCacheConnector: moves bytes, decides nothing (vLLM worker process, one per rank).

* ``register_kv_caches``: recognises the KV layout (refusing unknown ones at
  start-up, see ``lmi_cache.transfer.layouts``), builds the paged copiers and
  this rank's engine (one :class:`CacheEngine` per worker process).
* ``load`` (from ``start_load_kv``, before the forward pass): first applies
  the placement directory's evictions to this rank's tiers (a load never reads
  what it evicts), then hands the step's planned loads to ``chunk_loads``,
  which reads them from the tiers the directory named and scatters them into
  vLLM's cache; a load that fails makes vLLM recompute its blocks and skips
  its request's saves of this step.
* ``save`` (from ``wait_for_save``, after the forward pass): gathers every full
  chunk of the step in one kernel call straight into engine memory
  (``CacheEngine.save_many``; one copy) and puts it into the tiers the
  directory named; the disk and remote writes run asynchronously. The gather is the only cost on the step;
  ``stats.save_seconds`` measures it.
* ``build_worker_meta``: the stores that landed or failed, entries its media
  lost on their own, and (until the scheduler has them: ``layout_known``)
  this rank's layout tag and chunk sizes.

With vLLM's hybrid KV cache manager on, each KV cache group has its own
copier (``rank_copiers``); a transfer names its group
(``ChunkTransfer.group``), so a chunk holds one group's layers only.

Every engine or transfer call is wrapped: a fault is a miss, a warning and a
counter, never an exception into vLLM.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from lmi_cache.keys.kv_groups import KvCacheGroup
from lmi_cache.placement.messages import REMOTE, TierEvent
from lmi_cache.transfer.layouts import ExpectedGeometry, LayoutDescriptor
from lmi_cache.transfer.mixed_copy import MixedPagedCopier
from lmi_cache.transfer.paged_copy import PagedChunkCopier
from lmi_cache.transfer.state_copy import StateCopier
from lmi_cache.vllm_connector.chunk_loads import ChunkLoads
from lmi_cache.vllm_connector.metadata import ChunkTransfer, LmiConnectorMetadata, LmiWorkerMeta
from lmi_cache.vllm_connector.rank_copiers import build_rank_copiers
from lmi_cache.vllm_connector.worker_stats import WorkerStats

if TYPE_CHECKING:
    from lmi_cache.engine import Engine

logger = logging.getLogger(__name__)

# Warn on the first faults, then only every this-many, so a broken disk does not flood logs.
WARN_EVERY_FAULTS = 100


class WorkerSide:
    """One rank's transfer state; see the module docstring."""

    def __init__(
        self,
        *,
        rank_index: int,
        geometry: ExpectedGeometry,
        chunk_size_tokens: int,
        engine_factory: Callable[[], Engine],
        groups: tuple[KvCacheGroup, ...] = (),
    ) -> None:
        if chunk_size_tokens % geometry.block_size_tokens:
            raise ValueError("chunk size must be a multiple of the block size")
        self.rank_index = rank_index
        self._geometry = geometry
        self._blocks_per_chunk = chunk_size_tokens // geometry.block_size_tokens
        self._engine_factory = engine_factory
        self.engine: Engine | None = None
        self.layout: LayoutDescriptor | None = None
        self.copier: PagedChunkCopier | MixedPagedCopier | None = None  # group 0's (the only one without the hybrid manager)
        self._groups = groups  # () or one full-attention group: every layer in one chunk, in vLLM's order
        self._copiers: dict[int, PagedChunkCopier | MixedPagedCopier] = {}
        self._indexer_tag = ""  # the layout tag of both layouts when a group holds indexer keys
        self._states: dict[int, StateCopier] = {}  # state groups (Mamba layers)
        # Counted in the engine's registry once it exists (the first count, or the first step's report).
        self.stats = WorkerStats(lambda: self.engine.metrics if self.engine is not None else None, str(rank_index))
        self._loads = ChunkLoads(self.stats, self._fault, self._blocks_per_chunk)
        self._instructed: list[TierEvent] = []  # stores and promotions the directory planned this step
        self._num_warnings = 0
        self._layout_known = False  # the scheduler has this rank's layout tag and chunk sizes

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        copiers = build_rank_copiers(kv_caches, self._geometry, self._groups, self._blocks_per_chunk)
        self.layout, self._copiers, self._states = copiers.layout, copiers.paged, copiers.states
        self._indexer_tag = copiers.indexer_tag
        self.copier = next(iter(self._copiers.values()))
        self.engine = self._engine_factory()
        self.engine.expect_chunks(max(self._chunk_bytes().values()))
        self._loads.attach(self.engine, self._copiers, self._states)
        logger.info(
            "lmi-cache: rank %d registered %d KV layers in %d group(s), layout %s, %s bytes per chunk",
            self.rank_index, len(kv_caches), len(self._copiers) + len(self._states), self.layout_tag,
            "/".join(str(n) for n in self._chunk_bytes().values()),
        )

    @property
    def layout_tag(self) -> str:
        """This rank's KV layout in the chunk-key namespace: both layouts when a group mixes indexer keys in."""
        assert self.layout is not None
        return self._indexer_tag or self.layout.tag

    def _chunk_bytes(self) -> dict[int, int]:
        """Payload bytes of one chunk per group (a state group's: one boundary state), in group order."""
        copiers = self._all_copiers()
        return {g: copiers[g].chunk_bytes for g in sorted(copiers)}

    def _all_copiers(self) -> dict[int, PagedChunkCopier | MixedPagedCopier | StateCopier]:
        """Every group's copier: paged for attention groups, a state copier for state groups."""
        return {**self._copiers, **self._states}

    def _fault(self, what: str, err: BaseException | None, op: str = "load") -> None:
        """A fault of ``op`` ("load", "save", "events"): a tier-error metric and a rate-limited warning.

        A load fault's chunk is also reported dropped (the directory forgets it); a failed save is only a
        future miss.
        """
        metrics = self.engine.metrics if self.engine is not None else None
        if metrics is not None:
            try:
                # lmi_cache_tier_errors_total{tier="connector", op=...}
                metrics.error("connector", op)
            except Exception:  # noqa: BLE001 - metrics must never break a step
                pass
        self._warn_faults(f"{what} ({err or 'missing'})")

    def _warn_faults(self, what: str) -> None:
        total = self.stats.num_load_faults + self.stats.num_save_faults
        self._num_warnings += 1
        if self._num_warnings <= 3 or self._num_warnings % WARN_EVERY_FAULTS == 0:
            logger.warning("lmi-cache: %s; treated as a miss [%d faults so far]", what, total)

    def load(self, meta: LmiConnectorMetadata) -> None:
        engine = self.engine
        self._layout_known = self._layout_known or meta.layout_known
        if engine is not None and meta.evictions.get(self.rank_index):
            self._apply_evictions(engine, meta)
        if meta.loads and engine is not None and self.copier is not None:
            # A promotion is a store the directory planned: answered like the step's saves.
            self._instructed.extend(TierEvent(t.promote_to, t.keys[self.rank_index].digest)
                                    for t in meta.loads if t.promote_to)
        self._loads.load(meta, self.rank_index)

    def _apply_evictions(self, engine: Engine, meta: LmiConnectorMetadata) -> None:
        """The directory's evictions of this rank, before the loads (a load never reads what it evicts)."""
        try:
            for eviction in meta.evictions.get(self.rank_index, ()):
                engine.evict(eviction.tier, eviction.digest, eviction.demote_to)
                if eviction.demote_to:
                    self._instructed.append(TierEvent(eviction.demote_to, eviction.digest))
        except Exception as err:  # noqa: BLE001 - a tier that keeps an entry only wastes room
            self._fault("could not apply evictions", err, op="evict")

    def take_async_results(self) -> tuple[set[str], set[str]]:
        """Asynchronous loads finished since the last call: (landed, failed)."""
        return self._loads.take_async_results()

    def save(self, meta: LmiConnectorMetadata) -> None:
        try:
            self._save(meta)
        finally:
            # Load faults only poison this step's saves.
            self._loads.end_step()

    def _save(self, meta: LmiConnectorMetadata) -> None:
        engine = self.engine
        if not meta.saves or self.copier is None or engine is None:
            return
        # Every planned store is answered: it lands, or it is reported failed (a skipped one too).
        self._instructed.extend(TierEvent(tier, t.keys[self.rank_index].digest) for t in meta.saves for tier in t.tiers)
        started = time.perf_counter()
        for group, copier in self._all_copiers().items():
            transfers = [t for t in meta.saves if t.group == group and not self._loads.load_failed(t.req_id)]
            if transfers:
                self._save_group(engine, transfers, copier)
        self.stats.add(WorkerStats.save_seconds, time.perf_counter() - started)

    def _save_group(self, engine: Engine, transfers: list[ChunkTransfer],
                    copier: PagedChunkCopier | MixedPagedCopier | StateCopier) -> None:
        keys = [t.keys[self.rank_index] for t in transfers]
        block_ids = [t.block_ids for t in transfers]
        try:
            # Every full chunk of the step gathered in one kernel call, straight into engine memory.
            # (A state group's chunk is one block's state, gathered now: vLLM keeps an offered block this step only.)
            saved = engine.save_many(keys, copier.chunk_shape, copier.dtype,
                                     lambda outs: copier.gather_many(block_ids, outs),
                                     [t.tiers for t in transfers])
            self.stats.add(WorkerStats.num_chunks_saved, sum(saved))
            self.stats.add(WorkerStats.num_saves_refused, len(saved) - sum(saved))
        except Exception as err:  # noqa: BLE001 - a cache fault must never fail a request
            self.stats.add(WorkerStats.num_save_faults, len(transfers))
            self._fault(f"could not save {len(transfers)} chunk(s)", err, op="save")

    def expect_stores(self, events: Iterable[TierEvent]) -> None:
        """Stores planned by the directory that another component (blending) makes: reported like this side's."""
        self._instructed.extend(events)

    def load_failed(self, req_id: str) -> bool:
        """Whether a chunk of ``req_id`` failed to load this step (its blocks after it are recomputed)."""
        return self._loads.load_failed(req_id)

    def take_failed_block_ids(self) -> set[int]:
        return self._loads.take_failed_block_ids()

    def build_worker_meta(self) -> LmiWorkerMeta | None:
        if self.layout is None or self.engine is None:
            return None
        stored: list[TierEvent] = []
        dropped = self._loads.take_dropped()
        instructed, self._instructed = self._instructed, []
        try:
            new_stored, new_dropped = self.engine.drain_events()
            stored.extend(new_stored)
            dropped.extend(new_dropped)
        except Exception as err:  # noqa: BLE001
            self._fault("could not drain engine events", err, op="events")
        landed = {(e.tier, e.digest) for e in stored}
        failed = [e for e in instructed if e.tier != REMOTE and (e.tier, e.digest) not in landed]
        self.stats.attach(self.engine.metrics)  # the series are present from the first step, at 0
        rank = self.rank_index
        known = self._layout_known
        return LmiWorkerMeta(
            layout_tags={} if known else {rank: self.layout_tag},
            chunk_bytes={} if known else {rank: self._chunk_bytes()},
            stored={rank: stored} if stored else {},
            failed={rank: failed} if failed else {},
            dropped={rank: dropped} if dropped else {},
        )

    def shutdown(self) -> None:
        if self.engine is None:
            return
        self._loads.release_finished(wait=True)
        logger.info("lmi-cache: rank %d worker stats %s", self.rank_index, self.stats)
        try:
            self.engine.flush(10.0)
            self.engine.close()
        except Exception as err:  # noqa: BLE001
            logger.warning("lmi-cache: engine shutdown failed: %s", err)
        self.engine = None

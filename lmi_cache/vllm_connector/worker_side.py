"""Worker half of LmiCacheConnector: moves bytes, decides nothing (vLLM worker process, one per rank).

* ``register_kv_caches``: recognises the KV layout (refusing unknown ones at
  start-up, see ``lmi_cache.transfer.layouts``), builds the paged copier and
  this rank's engine (one :class:`CacheEngine` per worker process).
* ``load`` (from ``start_load_kv``, before the forward pass): first applies
  the placement directory's evictions to this rank's tiers, then asks the
  engine for all planned chunks of the step in one call, each from the tier
  the directory named (``CacheEngine.load``), and
  scatters each batch of hits into vLLM's cache as it arrives, straight from
  the engine's buffers (a CPU-tier hit is copied once). On CUDA the copies are
  asynchronous; the chunk objects are released once their event completes. A
  chunk the engine no longer has (stale index, evicted, corrupt on disk) or
  that fails to copy is a fault: its block ids are reported through
  ``take_failed_block_ids`` so vLLM recomputes them, its entry is reported
  dropped so the directory forgets it, and the request's saves for this
  step are skipped (its KV may have been computed on zeroed blocks).
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
(``ChunkTransfer.group``), so a chunk holds one group's layers only. A state
group's load scatters one boundary state into the one block named; a payload
of another geometry is a load fault.

Every engine or transfer call is wrapped: a fault is a miss, a warning and a
counter, never an exception into vLLM.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from lmi_cache.keys.kv_groups import KvCacheGroup
from lmi_cache.metrics.counts import Count, RankCounts
from lmi_cache.placement.messages import REMOTE, TierEvent
from lmi_cache.transfer.layouts import ExpectedGeometry, LayoutDescriptor
from lmi_cache.transfer.mixed_copy import MixedPagedCopier
from lmi_cache.transfer.paged_copy import PagedChunkCopier
from lmi_cache.transfer.state_copy import StateCopier
from lmi_cache.vllm_connector.metadata import ChunkTransfer, LmiConnectorMetadata, LmiWorkerMeta
from lmi_cache.vllm_connector.rank_copiers import build_rank_copiers

if TYPE_CHECKING:
    from lmi_cache.keys.hashing import ChunkKey
    from lmi_cache.engine import Engine
    from lmi_cache.tiers.host_memory import ChunkObject

logger = logging.getLogger(__name__)

# Warn on the first faults, then only every this-many, so a broken disk does not flood logs.
WARN_EVERY_FAULTS = 100


class WorkerStats(RankCounts):
    """This rank's connector counts, each the rank's ``lmi_cache_worker_*`` series (``metrics.counts``)."""

    what = "worker metrics"
    num_chunks_loaded = Count("lmi_cache_worker_loaded_chunks", "Chunks copied into vLLM's KV cache")
    num_chunks_saved = Count("lmi_cache_worker_saved_chunks", "Chunks gathered after forward passes and stored")
    num_saves_refused = Count("lmi_cache_worker_refused_saves", "Chunks the engine refused to store (no room)")
    num_load_faults = Count("lmi_cache_worker_load_faults", "Planned chunks that did not land (vLLM recomputes them)")
    num_save_faults = Count("lmi_cache_worker_save_faults", "Chunks whose gather or store failed (a future miss)")
    load_bytes = Count("lmi_cache_worker_loaded_bytes", "KV bytes copied into vLLM's KV cache by loads")
    # The connector's own time on vLLM's model thread, which no tier series shows (a save's gather and a
    # load's wait for its reads and copies happen between forward passes).
    load_seconds = Count("lmi_cache_worker_load_seconds",
                         "Seconds the model thread spent reading hits and copying them into vLLM's KV cache")
    save_seconds = Count("lmi_cache_worker_save_seconds",
                         "Seconds the model thread spent gathering and storing chunks after forward passes")


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
        self._failed_block_ids: set[int] = set()
        self._failed_req_ids: set[str] = set()
        self._async_done: set[str] = set()  # asynchronous loads of this step that landed
        self._async_failed: set[str] = set()  # ... and that did not (vLLM recomputes those requests)
        self._dropped: list[TierEvent] = []  # entries a load found missing or damaged
        self._mismatched_loads = 0  # this step's loads refused for their token fingerprint, not yet attributed
        self._instructed: list[TierEvent] = []  # stores and promotions the directory planned this step
        self._num_warnings = 0
        self._layout_known = False  # the scheduler has this rank's layout tag and chunk sizes
        self._last_event: Any = None  # the latest asynchronous scatter of this step (CUDA), or None
        self._pending_releases: list[tuple[Any, list[Any]]] = []  # (copy-done event or None, chunk objects)

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        copiers = build_rank_copiers(kv_caches, self._geometry, self._groups, self._blocks_per_chunk)
        self.layout, self._copiers, self._states = copiers.layout, copiers.paged, copiers.states
        self._indexer_tag = copiers.indexer_tag
        self.copier = next(iter(self._copiers.values()))
        self.engine = self._engine_factory()
        self.engine.expect_chunks(max(self._chunk_bytes().values()))
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
        planned = {t.req_id for t in meta.loads}
        # A waiting request with nothing to load (its plan found no blocks) must still be answered, or it waits forever.
        self._async_failed |= {r for r in meta.async_loads if r not in planned or self.copier is None or engine is None}
        if not meta.loads or self.copier is None or engine is None:
            return
        started = time.perf_counter()
        self._release_finished_loads()
        keys = [transfer.keys[self.rank_index] for transfer in meta.loads]
        sources = [t.source for t in meta.loads]
        promote = [bool(t.promote_to) for t in meta.loads]
        for transfer, key in zip(meta.loads, keys):
            if transfer.promote_to:
                self._instructed.append(TierEvent(transfer.promote_to, key.digest))
        loaded: set[int] = set()
        mismatches_before = self._fingerprint_mismatches()
        held: list[ChunkObject] = []  # chunk objects the copies read from: released once the copies are done
        arrived: list[tuple[int, ChunkObject]] = []  # hits not copied yet (CPU backend: copied once, after the reads)
        overlap = self.copier.overlaps_host_work
        try:
            # One batched call: CPU-tier hits first (straight from the tier's buffers), then disk reads
            # as they finish and remote hits from one round trip. With CUDA each batch is scattered on
            # arrival (asynchronous copies overlap the reads still running); on the CPU backend all hits
            # are scattered in one call after the reads, so the copy's OpenMP threads never wait for cores
            # that reader threads hold.
            for batch in engine.load(keys, sources, promote):
                held.extend(obj for _, obj in batch)
                if overlap:
                    loaded.update(self._scatter_groups(meta, batch))
                else:
                    arrived.extend(batch)
        except Exception as err:  # noqa: BLE001 - a cache fault must never fail a request
            self._fault("chunk load failed", err)
        if arrived:
            loaded.update(self._scatter_groups(meta, arrived))
        self._mismatched_loads = max(0, int(self._fingerprint_mismatches() - mismatches_before))
        self._finish_loads(meta, keys, loaded)
        self._pending_releases.append((self._last_event, held))
        self._last_event = None
        self._release_finished_loads()
        self.stats.add(WorkerStats.load_seconds, time.perf_counter() - started)

    def _apply_evictions(self, engine: Engine, meta: LmiConnectorMetadata) -> None:
        """The directory's evictions of this rank, before the loads (a load never reads what it evicts)."""
        try:
            for eviction in meta.evictions.get(self.rank_index, ()):
                engine.evict(eviction.tier, eviction.digest, eviction.demote_to)
                if eviction.demote_to:
                    self._instructed.append(TierEvent(eviction.demote_to, eviction.digest))
        except Exception as err:  # noqa: BLE001 - a tier that keeps an entry only wastes room
            self._fault("could not apply evictions", err, op="evict")

    def _scatter_groups(self, meta: LmiConnectorMetadata, batch: list[tuple[int, ChunkObject]]) -> list[int]:
        """Copy a batch of hits into the paged cache, one kernel call per KV cache group; the positions that landed."""
        landed: list[int] = []
        for group, copier in self._copiers.items():
            part = [item for item in batch if meta.loads[item[0]].group == group]
            if part:
                landed.extend(self._scatter(meta, part, copier))
        per_block = {g: c.chunk_bytes // self._blocks_per_chunk for g, c in self._copiers.items()}
        self.stats.add(WorkerStats.load_bytes,
                       sum(len(meta.loads[p].block_ids) * per_block[meta.loads[p].group] for p in landed))
        for position, obj in batch:
            state = self._states.get(meta.loads[position].group)
            if state is not None and self._scatter_state(state, meta.loads[position], obj):
                landed.append(position)
                self.stats.add(WorkerStats.load_bytes, state.chunk_bytes)
        return landed

    def _scatter_state(self, state: StateCopier, transfer: ChunkTransfer, obj: ChunkObject) -> bool:
        """Write one boundary state into its block; a payload of another geometry (StateShapeError) is a fault."""
        try:
            state.scatter(transfer.block_ids[0], obj.payload_tensor())
            return True
        except Exception as err:  # noqa: BLE001 - a wrong state is a miss, never a wrong continuation
            self._fault(f"could not copy state {obj.key.digest.hex()[:12]}", err)
            return False

    def _scatter(self, meta: LmiConnectorMetadata, batch: list[tuple[int, ChunkObject]],
                 copier: PagedChunkCopier | MixedPagedCopier) -> list[int]:
        """Copy one batch of one group's hits into the paged cache in one kernel call; the positions that landed."""
        transfers = [meta.loads[position] for position, _ in batch]
        try:
            self._last_event = copier.scatter_many(
                [obj.payload_tensor() for _, obj in batch], [t.block_ids for t in transfers],
                [t.block_offset for t in transfers],
            ) or self._last_event
            return [position for position, _ in batch]
        except Exception as err:  # noqa: BLE001 - a wrong chunk is a miss; retry the others one by one
            if len(batch) == 1:
                self._fault(f"could not copy chunk {batch[0][1].key.digest.hex()[:12]}", err)
                return []
            landed: list[int] = []
            for item in batch:
                landed.extend(self._scatter(meta, [item], copier))
            return landed

    def _finish_loads(self, meta: LmiConnectorMetadata, keys: list[ChunkKey], loaded: set[int]) -> None:
        """Count loads; a chunk that did not land fails its blocks (vLLM recomputes them) and its request's saves."""
        self._finish_load_blocks(meta, keys, loaded)
        waiting = set(meta.async_loads) & {t.req_id for t in meta.loads}
        if waiting:
            # An asynchronous load is reported by request, never by block ids: with several KV cache groups a
            # block id is not unique, and vLLM recomputes a failed waiting request from its first token.
            self._async_failed |= waiting & self._failed_req_ids
            self._async_done |= waiting - self._failed_req_ids
            ids = {b for t in meta.loads if t.req_id in waiting for b in t.block_ids}
            self._failed_block_ids -= ids

    def take_async_results(self) -> tuple[set[str], set[str]]:
        """Asynchronous loads finished since the last call: (landed, failed)."""
        done, failed = self._async_done, self._async_failed
        self._async_done, self._async_failed = set(), set()
        return done, failed

    def _finish_load_blocks(self, meta: LmiConnectorMetadata, keys: list[ChunkKey], loaded: set[int]) -> None:
        for position, transfer in enumerate(meta.loads):
            if transfer.req_id in self._failed_req_ids:
                # vLLM truncates at the first failed block; later ones are recomputed anyway.
                self._failed_block_ids.update(transfer.block_ids)
                continue
            if position in loaded:
                self.stats.add(WorkerStats.num_chunks_loaded)
                continue
            self._failed_block_ids.update(transfer.block_ids)
            self.stats.add(WorkerStats.num_load_faults)
            self._failed_req_ids.add(transfer.req_id)
            # The tiers count refused fingerprints, not which chunk: this step's first failed loads take them.
            reason = "key_mismatch" if self._mismatched_loads > 0 else "failed_load"
            self._mismatched_loads -= reason == "key_mismatch"
            self._dropped.append(TierEvent(transfer.source, keys[position].digest, reason=reason))
            self._fault(f"could not load chunk {keys[position].digest.hex()[:12]} for request {transfer.req_id}", None)

    def _fingerprint_mismatches(self) -> float:
        """Loads the tiers of this rank refused for a foreign token fingerprint, so far."""
        metrics = self.engine.metrics if self.engine is not None else None
        if metrics is None:
            return 0.0
        return metrics.fingerprint_mismatches()

    def _release_finished_loads(self, wait: bool = False) -> None:
        """Give back the chunk objects of loads whose copies have completed (all of them with ``wait``)."""
        keep: list[tuple[Any, list[Any]]] = []
        for event, objs in self._pending_releases:
            if event is None or wait or event.query():
                if event is not None and wait:
                    event.synchronize()
                for obj in objs:
                    obj.release()
            else:
                keep.append((event, objs))
        self._pending_releases = keep

    def save(self, meta: LmiConnectorMetadata) -> None:
        try:
            self._save(meta)
        finally:
            # Load faults only poison this step's saves.
            self._failed_req_ids.clear()

    def _save(self, meta: LmiConnectorMetadata) -> None:
        engine = self.engine
        if not meta.saves or self.copier is None or engine is None:
            return
        # Every planned store is answered: it lands, or it is reported failed (a skipped one too).
        self._instructed.extend(TierEvent(tier, t.keys[self.rank_index].digest) for t in meta.saves for tier in t.tiers)
        started = time.perf_counter()
        for group, copier in self._all_copiers().items():
            transfers = [t for t in meta.saves if t.group == group and t.req_id not in self._failed_req_ids]
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
        return req_id in self._failed_req_ids

    def take_failed_block_ids(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def build_worker_meta(self) -> LmiWorkerMeta | None:
        if self.layout is None or self.engine is None:
            return None
        stored: list[TierEvent] = []
        dropped, self._dropped = self._dropped, []
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
        self._release_finished_loads(wait=True)
        logger.info("lmi-cache: rank %d worker stats %s", self.rank_index, self.stats)
        try:
            self.engine.flush(10.0)
            self.engine.close()
        except Exception as err:  # noqa: BLE001
            logger.warning("lmi-cache: engine shutdown failed: %s", err)
        self.engine = None

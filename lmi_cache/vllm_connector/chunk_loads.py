"""One rank's chunk loads into vLLM's paged KV cache, and their faults (vLLM worker process).

The worker side (``worker_side.py``) hands each step's planned loads here, after it has applied the
directory's evictions. All chunks of the step go to the engine in one call, each asked of the tier the
directory named (``Engine.load``), and each batch of hits is scattered into vLLM's cache straight from the
engine's buffers (a CPU-tier hit is copied once). On CUDA the copies are asynchronous and the chunk objects
are released once their event completes.

A chunk the engine no longer has (stale index, evicted, corrupt on disk) or that fails to copy is a fault:
its block ids go to ``take_failed_block_ids`` so vLLM recomputes them, its entry is reported dropped so the
directory forgets it, and its request's saves of this step are skipped (``load_failed``: its KV may have
been computed on zeroed blocks). Asynchronous loads (models that are not one full-attention group) are
answered by request in ``take_async_results``.

A state group's load scatters one boundary state into the one block named; a payload of another geometry
is a load fault.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmi_cache.placement.messages import TierEvent
from lmi_cache.transfer.mixed_copy import MixedPagedCopier
from lmi_cache.transfer.paged_copy import PagedChunkCopier
from lmi_cache.transfer.state_copy import StateCopier
from lmi_cache.vllm_connector.metadata import ChunkTransfer, LmiConnectorMetadata
from lmi_cache.vllm_connector.worker_stats import WorkerStats

if TYPE_CHECKING:
    from lmi_cache.engine import Engine
    from lmi_cache.keys.hashing import ChunkKey
    from lmi_cache.tiers.host_memory import ChunkObject

# fault(what, error or None): a load fault's metric and rate-limited warning, kept by the worker side.
FaultReport = Callable[[str, "BaseException | None"], None]


class ChunkLoads:
    """A rank's loads of one step and what they leave for vLLM and the directory; see the module docstring."""

    def __init__(self, stats: WorkerStats, fault: FaultReport, blocks_per_chunk: int) -> None:
        self._stats = stats
        self._fault = fault
        self._blocks_per_chunk = blocks_per_chunk
        self._engine: Engine | None = None
        self._copiers: dict[int, PagedChunkCopier | MixedPagedCopier] = {}
        self._states: dict[int, StateCopier] = {}
        self._failed_block_ids: set[int] = set()
        self._failed_req_ids: set[str] = set()
        self._async_done: set[str] = set()  # asynchronous loads of this step that landed
        self._async_failed: set[str] = set()  # ... and that did not (vLLM recomputes those requests)
        self._dropped: list[TierEvent] = []  # entries a load found missing or damaged
        self._mismatched_loads = 0  # this step's loads refused for their token fingerprint, not yet attributed
        self._last_event: Any = None  # the latest asynchronous scatter of this step (CUDA), or None
        self._pending_releases: list[tuple[Any, list[Any]]] = []  # (copy-done event or None, chunk objects)

    def attach(self, engine: Engine, copiers: dict[int, PagedChunkCopier | MixedPagedCopier],
               states: dict[int, StateCopier]) -> None:
        """The rank's engine and copiers, once vLLM has registered its KV caches."""
        self._engine, self._copiers, self._states = engine, copiers, states

    def load(self, meta: LmiConnectorMetadata, rank: int) -> None:
        """Read and scatter the step's planned loads of ``rank``; faults are recorded, never raised."""
        engine = self._engine
        planned = {t.req_id for t in meta.loads}
        # A waiting request with nothing to load (its plan found no blocks) must still be answered, or it waits forever.
        self._async_failed |= {r for r in meta.async_loads if r not in planned or not self._copiers or engine is None}
        if not meta.loads or not self._copiers or engine is None:
            return
        started = time.perf_counter()
        self.release_finished()
        keys = [transfer.keys[rank] for transfer in meta.loads]
        sources = [t.source for t in meta.loads]
        promote = [bool(t.promote_to) for t in meta.loads]
        loaded: set[int] = set()
        mismatches_before = self._fingerprint_mismatches()
        held: list[ChunkObject] = []  # chunk objects the copies read from: released once the copies are done
        arrived: list[tuple[int, ChunkObject]] = []  # hits not copied yet (CPU backend: copied once, after the reads)
        overlap = next(iter(self._copiers.values())).overlaps_host_work
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
        self._finish(meta, keys, loaded)
        self._pending_releases.append((self._last_event, held))
        self._last_event = None
        self.release_finished()
        self._stats.add(WorkerStats.load_seconds, time.perf_counter() - started)

    def _scatter_groups(self, meta: LmiConnectorMetadata, batch: list[tuple[int, ChunkObject]]) -> list[int]:
        """Copy a batch of hits into the paged cache, one kernel call per KV cache group; the positions that landed."""
        landed: list[int] = []
        for group, copier in self._copiers.items():
            part = [item for item in batch if meta.loads[item[0]].group == group]
            if part:
                landed.extend(self._scatter(meta, part, copier))
        per_block = {g: c.chunk_bytes // self._blocks_per_chunk for g, c in self._copiers.items()}
        self._stats.add(WorkerStats.load_bytes,
                        sum(len(meta.loads[p].block_ids) * per_block[meta.loads[p].group] for p in landed))
        for position, obj in batch:
            state = self._states.get(meta.loads[position].group)
            if state is not None and self._scatter_state(state, meta.loads[position], obj):
                landed.append(position)
                self._stats.add(WorkerStats.load_bytes, state.chunk_bytes)
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

    def _finish(self, meta: LmiConnectorMetadata, keys: list[ChunkKey], loaded: set[int]) -> None:
        """Count loads; a chunk that did not land fails its blocks (vLLM recomputes them) and its request's saves."""
        self._finish_blocks(meta, keys, loaded)
        waiting = set(meta.async_loads) & {t.req_id for t in meta.loads}
        if waiting:
            # An asynchronous load is reported by request, never by block ids: with several KV cache groups a
            # block id is not unique, and vLLM recomputes a failed waiting request from its first token.
            self._async_failed |= waiting & self._failed_req_ids
            self._async_done |= waiting - self._failed_req_ids
            ids = {b for t in meta.loads if t.req_id in waiting for b in t.block_ids}
            self._failed_block_ids -= ids

    def _finish_blocks(self, meta: LmiConnectorMetadata, keys: list[ChunkKey], loaded: set[int]) -> None:
        for position, transfer in enumerate(meta.loads):
            if transfer.req_id in self._failed_req_ids:
                # vLLM truncates at the first failed block; later ones are recomputed anyway.
                self._failed_block_ids.update(transfer.block_ids)
                continue
            if position in loaded:
                self._stats.add(WorkerStats.num_chunks_loaded)
                continue
            self._failed_block_ids.update(transfer.block_ids)
            self._stats.add(WorkerStats.num_load_faults)
            self._failed_req_ids.add(transfer.req_id)
            # The tiers count refused fingerprints, not which chunk: this step's first failed loads take them.
            reason = "key_mismatch" if self._mismatched_loads > 0 else "failed_load"
            self._mismatched_loads -= reason == "key_mismatch"
            self._dropped.append(TierEvent(transfer.source, keys[position].digest, reason=reason))
            self._fault(f"could not load chunk {keys[position].digest.hex()[:12]} for request {transfer.req_id}", None)

    def _fingerprint_mismatches(self) -> float:
        """Loads the tiers of this rank refused for a foreign token fingerprint, so far."""
        metrics = self._engine.metrics if self._engine is not None else None
        if metrics is None:
            return 0.0
        return metrics.fingerprint_mismatches()

    def release_finished(self, wait: bool = False) -> None:
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

    def load_failed(self, req_id: str) -> bool:
        """Whether a chunk of ``req_id`` failed to load this step (its blocks after it are recomputed)."""
        return req_id in self._failed_req_ids

    def end_step(self) -> None:
        """After the step's saves: load faults only poison the saves of their own step."""
        self._failed_req_ids.clear()

    def take_async_results(self) -> tuple[set[str], set[str]]:
        """Asynchronous loads finished since the last call: (landed, failed)."""
        done, failed = self._async_done, self._async_failed
        self._async_done, self._async_failed = set(), set()
        return done, failed

    def take_failed_block_ids(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def take_dropped(self) -> list[TierEvent]:
        """Entries the loads found missing or damaged since the last call (reported dropped to the directory)."""
        dropped, self._dropped = self._dropped, []
        return dropped

"""Worker half of LmiCacheConnector: moves bytes, decides nothing (vLLM worker process, one per rank).

* ``register_kv_caches``: recognises the KV layout (refusing unknown ones at
  start-up, see ``lmi_cache.transfer.layouts``), builds the paged copier and
  this rank's engine (one :class:`CacheEngine` per worker process).
* ``load`` (from ``start_load_kv``, before the forward pass, synchronous):
  retrieves each planned chunk from the engine and scatters its blocks into
  vLLM's cache. A chunk the engine no longer has (stale index, evicted,
  corrupt on disk) or that fails to copy is a fault: its block ids are reported
  through ``take_failed_block_ids`` so vLLM recomputes them, its digest is
  reported removed so the scheduler's index heals, and the request's saves for
  this step are skipped (its KV may have been computed on zeroed blocks).
* ``save`` (from ``wait_for_save``, after the forward pass): gathers each full
  chunk straight into engine memory (``CacheEngine.store_from``; one copy),
  and the engine writes it to disk asynchronously. The gather is the only cost
  on the step; ``stats.save_seconds`` measures it.
* ``build_worker_meta``: this rank's stored/removed digests and layout tag.

Every engine or transfer call is wrapped: a fault is a miss, a warning and a
counter, never an exception into vLLM.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lmi_cache.transfer.layouts import ExpectedGeometry, LayoutDescriptor, describe_kv_caches
from lmi_cache.transfer.paged_copy import PagedChunkCopier
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata, LmiWorkerMeta

logger = logging.getLogger(__name__)

# Warn on the first faults, then only every this-many, so a broken disk does not flood logs.
WARN_EVERY_FAULTS = 100


@dataclass
class WorkerStats:
    num_chunks_loaded: int = 0
    num_chunks_saved: int = 0
    num_saves_refused: int = 0
    num_load_faults: int = 0
    num_save_faults: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0


class WorkerSide:
    """One rank's transfer state; see the module docstring."""

    def __init__(
        self,
        *,
        rank_index: int,
        geometry: ExpectedGeometry,
        chunk_size_tokens: int,
        engine_factory: Callable[[], Any],
    ) -> None:
        if chunk_size_tokens % geometry.block_size_tokens:
            raise ValueError("chunk size must be a multiple of the block size")
        self.rank_index = rank_index
        self._geometry = geometry
        self._blocks_per_chunk = chunk_size_tokens // geometry.block_size_tokens
        self._engine_factory = engine_factory
        self.engine: Any = None
        self.layout: LayoutDescriptor | None = None
        self.copier: PagedChunkCopier | None = None
        self.stats = WorkerStats()
        self._failed_block_ids: set[int] = set()
        self._failed_req_ids: set[str] = set()
        self._removed_digests: list[bytes] = []
        self._num_new_faults = 0

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.layout = describe_kv_caches(kv_caches, self._geometry)
        self.copier = PagedChunkCopier(list(kv_caches.values()), self.layout, self._blocks_per_chunk)
        self.engine = self._engine_factory()
        logger.info(
            "lmi-cache: rank %d registered %d KV layers, layout %s, %d bytes per chunk",
            self.rank_index, len(kv_caches), self.layout.tag, self.copier.chunk_bytes,
        )

    def _fault(self, what: str, err: BaseException | None, op: str = "load") -> None:
        self._num_new_faults += 1
        metrics = getattr(self.engine, "metrics", None)
        if metrics is not None and hasattr(metrics, "error"):
            try:
                # lmi_cache_tier_errors_total{tier="connector", op=...}
                metrics.error("connector", op)
            except Exception:  # noqa: BLE001 - metrics must never break a step
                pass
        total = self.stats.num_load_faults + self.stats.num_save_faults
        if total <= 3 or total % WARN_EVERY_FAULTS == 0:
            logger.warning("lmi-cache: %s (%s); treated as a miss [%d faults so far]", what, err or "missing", total)

    def load(self, meta: LmiConnectorMetadata) -> None:
        if not meta.loads or self.copier is None:
            return
        started = time.perf_counter()
        stage = getattr(self.engine, "stage_remote", None)
        if stage is not None:  # chunks no local tier holds: one batched remote read for the whole step
            stage([transfer.keys[self.rank_index] for transfer in meta.loads])
        for transfer in meta.loads:
            if transfer.req_id in self._failed_req_ids:
                # vLLM truncates at the first failed block; later ones are recomputed anyway.
                self._failed_block_ids.update(transfer.block_ids)
                continue
            key = transfer.keys[self.rank_index]
            error: BaseException | None = None
            try:
                chunk = self.engine.retrieve(key, out=self.copier.reusable_host_buffer())
                if chunk is not None:
                    self.copier.scatter_chunk(chunk, transfer.block_ids, transfer.block_offset)
                    self.stats.num_chunks_loaded += 1
                    continue
            except Exception as err:  # noqa: BLE001 - a cache fault must never fail a request
                error = err
            self.stats.num_load_faults += 1
            self._failed_block_ids.update(transfer.block_ids)
            self._failed_req_ids.add(transfer.req_id)
            self._removed_digests.append(key.digest)
            self._fault(f"could not load chunk {key.digest.hex()[:12]} for request {transfer.req_id}", error)
        self.copier.synchronize()
        self.stats.load_seconds += time.perf_counter() - started

    def save(self, meta: LmiConnectorMetadata) -> None:
        try:
            self._save(meta)
        finally:
            # Load faults only poison this step's saves.
            self._failed_req_ids.clear()

    def _save(self, meta: LmiConnectorMetadata) -> None:
        if not meta.saves or self.copier is None:
            return
        started = time.perf_counter()
        for transfer in meta.saves:
            if transfer.req_id in self._failed_req_ids:
                continue
            key = transfer.keys[self.rank_index]
            try:
                copier, block_ids = self.copier, transfer.block_ids
                # Gather straight into engine memory: one copy on the critical path, not two.
                if self.engine.store_from(key, copier.chunk_shape, copier.dtype,
                                          lambda out: copier.gather_chunk(block_ids, out)):
                    self.stats.num_chunks_saved += 1
                else:
                    self.stats.num_saves_refused += 1
            except Exception as err:  # noqa: BLE001 - a cache fault must never fail a request
                self.stats.num_save_faults += 1
                self._fault(f"could not save chunk {key.digest.hex()[:12]}", err, op="save")
        self.stats.save_seconds += time.perf_counter() - started

    def take_failed_block_ids(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def build_worker_meta(self) -> LmiWorkerMeta | None:
        if self.layout is None:
            return None
        stored: list[bytes] = []
        removed: list[bytes] = list(self._removed_digests)
        self._removed_digests.clear()
        try:
            new_stored, new_removed = self.engine.drain_events()
            stored.extend(new_stored)
            removed.extend(new_removed)
        except Exception as err:  # noqa: BLE001
            self._fault("could not drain engine events", err, op="events")
        faults, self._num_new_faults = self._num_new_faults, 0
        return LmiWorkerMeta(
            layout_tags={self.rank_index: self.layout.tag},
            stored_digests={self.rank_index: stored} if stored else {},
            removed_digests={self.rank_index: removed} if removed else {},
            num_load_faults=faults,
        )

    def shutdown(self) -> None:
        if self.engine is None:
            return
        logger.info("lmi-cache: rank %d worker stats %s", self.rank_index, self.stats)
        try:
            self.engine.flush(10.0)
            self.engine.close()
        except Exception as err:  # noqa: BLE001
            logger.warning("lmi-cache: engine shutdown failed: %s", err)
        self.engine = None

"""CacheEngine: saves and loads of KV chunks over an ordered list of tiers (vLLM worker process).

Orchestration only: what goes where is the scheduler's placement directory's
decision (``lmi_cache.placement``), carried out here; tiers hold entries
(``tiers.base.Tier``: batched contains / get / put), ``tiers.host_memory`` owns
the bytes, ``keys.chunk_format`` defines them, ``keys.hashing.KeySpace`` makes
keys. The engine never
raises to its caller for a cache fault: a fault is a miss (or a refused save),
a rate-limited warning and a metric, and wrong bytes are never returned.

The serving verbs (the vLLM connector uses exactly these):

- ``save_many(keys, shape, dtype, fill, tiers) -> list[bool]``: store one
  chunk per key, all of the same ``shape``/``dtype``, into the tiers named per
  key (``tiers``, as the placement directory reserved them; "remote" is the
  shared store whatever backs it). The engine takes host buffers and calls
  ``fill(tensors)`` once with all of them (the connector gathers every chunk
  of the step in one kernel call straight into them); then each chunk object
  is put, by reference, into its tiers. Never waits for disk or network I/O.
  A ``fill`` that raises refuses the whole batch.
- ``load(keys, sources, promote) -> Iterator[list[(position, ChunkObject)]]``:
  the chunks found among ``keys``, each asked of its source tier, as batches
  yielded as they become ready: the CPU tier's hits at once (references to its
  own buffers: no copy), then each disk read as it finishes (reads run in
  parallel), then the remote store's hits from one batched round trip. A hit
  is put into the CPU tier by reference where ``promote`` says so (the
  directory reserved room there). The caller must
  ``release()`` every object it receives once its copies out of it are
  complete (on CUDA: once the asynchronous copy is done). Keys never yielded
  are misses.
- ``evict(tier, digest, demote_to)``: drop an entry the directory evicted,
  handing it to ``demote_to`` first (``disk_feed: demote``).
- ``expect_chunks(payload_bytes)``: the size of this rank's chunks (the
  worker knows it once vLLM's KV cache is registered), so the allocator keeps
  touched buffers of that size ready instead of faulting fresh memory in on
  vLLM's critical path.
- ``drain_events() -> (stored, dropped)``: ``TierEvent``s of entries put
  into a local tier, and of entries a local tier lost on its own (damaged,
  unreadable, a failed write) since the last call: what the worker reports to
  the placement directory.
- ``flush(timeout_s)``, ``clear()``, ``stats()``, ``close()``, ``metrics``,
  ``tiers``.

``Engine`` is the typed seam: the verbs the connector's worker side and its
blending component call, which ``CacheEngine`` implements (test doubles too).

There is no undirected mode: every put and every read names its tier, and
the tiers never evict on their own (a tier short of room refuses the put and
counts it, ``lmi_cache_tier_safety_net_total``). CPU-to-disk feeding
(``extra_config.disk_feed``) is the directory's too: ``write_through``
(default) plans every save into the disk tier as well; ``demote`` plans a
chunk into the disk tier only when the directory evicts it from the CPU tier
(``evict(..., demote_to="disk")``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from lmi_cache.keys.chunk_format import HEADER_BYTES, ChunkHeader
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.peer.hint import PEER, source_tier
from lmi_cache.placement.messages import REMOTE, TierEvent
from lmi_cache.tiers.base import HitBatch, Tier
from lmi_cache.tiers.buffers import dtype_name
from lmi_cache.tiers.factory import TierContext, build_tiers
from lmi_cache.tiers.host_memory import ChunkObject, HostAllocator

logger = logging.getLogger(__name__)

# Writes every chunk's payload: given one tensor per chunk (stored dtype and shape), in key order.
FillMany = Callable[[list[torch.Tensor]], None]


class Engine(Protocol):
    """A rank's engine as the vLLM connector's worker side and blending use it (see the module docstring)."""

    metrics: CacheMetrics

    def expect_chunks(self, payload_bytes: int) -> None: ...
    def save_many(self, keys: Sequence[ChunkKey], shape: tuple[int, ...], dtype: torch.dtype,
                  fill: FillMany, tiers: Sequence[Sequence[str]]) -> list[bool]: ...
    def load(self, keys: Sequence[ChunkKey], sources: Sequence[str],
             promote: Sequence[bool] | None = None) -> Iterator[HitBatch]: ...
    def evict(self, tier: str, digest: bytes, demote_to: str | None = None) -> None: ...
    def drain_events(self) -> tuple[list[TierEvent], list[TierEvent]]: ...
    def flush(self, timeout_s: float = 30.0) -> None: ...
    def close(self) -> None: ...


class CacheEngine:
    def __init__(
        self,
        config: CacheConfig,
        *,
        metrics: CacheMetrics | None = None,
        rank_label: str = "0",
        page_locked: bool | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else CacheMetrics(rank_label)
        self._warner = RateLimitedWarner(logger)
        self._events_lock = threading.Lock()
        self._stored_events: list[TierEvent] = []
        self._dropped_events: list[TierEvent] = []
        self._closed = False
        # Warm free buffers (a fresh 4 MiB buffer costs ~1,000 page faults on vLLM's critical path):
        # at most 256 MiB, about a full disk write queue of 4 MiB chunks; with a CPU tier, at most a
        # quarter of it (most buffers then live in the tier anyway), and beyond that the CPU tier's
        # unused budget (set_headroom below): until the tier is full, its buffers come touched.
        cpu_bytes = config.cpu_capacity_bytes
        pool_bytes = 256 << 20 if cpu_bytes <= 0 else min(256 << 20, max(cpu_bytes // 4, 32 << 20))
        self.allocator = HostAllocator(page_locked=page_locked, pool_limit_bytes=pool_bytes)
        self.tiers: list[Tier] = []
        context = TierContext(rank_label, self.metrics, self._warner, self.allocator, self._on_dropped)
        build_tiers(config, context, self.tiers)
        self.allocator.set_headroom(self._unused_buffer_budget)

    def _unused_buffer_budget(self) -> int:
        """Bytes the tiers that keep host buffers (the CPU tier) may still take."""
        return sum(max(0, t.capacity_bytes - t.used_bytes) for t in self.tiers if t.holds_host_buffers)

    def expect_chunks(self, payload_bytes: int) -> None:
        """Chunks of this rank carry ``payload_bytes``: keep touched buffers of that size ready."""
        self.allocator.keep_warm(HEADER_BYTES + payload_bytes)

    # ------------------------------------------------------------ save
    def save_many(self, keys: Sequence[ChunkKey], shape: tuple[int, ...], dtype: torch.dtype, fill: FillMany,
                  tiers: Sequence[Sequence[str]]) -> list[bool]:
        results = [False] * len(keys)
        fresh: list[tuple[int, ChunkObject]] = []
        try:
            num_bytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            for position, key in enumerate(keys):
                if not tiers[position]:
                    continue
                header = ChunkHeader.for_key(key, num_bytes, dtype_name(dtype), tuple(shape))
                obj = self.allocator.new_object(key, header)
                if obj is None:
                    self.metrics.dropped("engine", "no_memory")
                    continue
                fresh.append((position, obj))
            if fresh:
                fill([obj.payload_tensor() for _, obj in fresh])
        except Exception as err:  # the failure policy: never raise into vLLM
            for _, obj in fresh:
                obj.release()
            self.metrics.dropped("engine", "error")
            self._warner.warn("save", f"cache save failed ({err!r}); chunks not cached")
            return [False] * len(keys)
        for position, obj in fresh:
            try:
                results[position] = self._put(obj, tiers[position])
            finally:
                obj.release()
        return results

    def _put(self, obj: ChunkObject, names: Sequence[str]) -> bool:
        """Into the named tiers."""
        stored = False
        for tier in self.tiers:
            if _placement_name(tier) in names:
                stored = self._tier_put(tier, obj) or stored
        return stored

    def _tier_put(self, tier: Tier, obj: ChunkObject) -> bool:
        try:
            stored = tier.put(obj)
        except Exception as err:  # a tier bug must not lose the others' copies
            self.metrics.error(tier.name, "save")
            self._warner.warn(f"put-{tier.name}", f"{tier.name} tier: put failed ({err!r}); chunk not stored there")
            return False
        if stored and tier.local:
            self._event(self._stored_events, TierEvent(tier.name, obj.key.digest, obj.header.payload_bytes))
        return stored

    # ------------------------------------------------------------ load
    def load(self, keys: Sequence[ChunkKey], sources: Sequence[str],
             promote: Sequence[bool] | None = None) -> Iterator[HitBatch]:
        """Hits among ``keys``, each asked of its ``sources`` tier only, and promoted into the first tier where
        ``promote`` says so (the placement directory decided both)."""
        promoted = [bool(promote and promote[i]) for i in range(len(keys))]
        for number, tier in enumerate(self.tiers):
            asked = [i for i in range(len(keys)) if source_tier(sources[i]) == _placement_name(tier)]
            if not asked:
                continue
            started = time.perf_counter()
            batches = tier.get_many_from([keys[i] for i in asked], [sources[i] for i in asked])
            try:
                for batch in batches:
                    hits = [(asked[j], obj) for j, obj in batch]
                    for position, obj in hits:
                        self.metrics.loaded(tier.name, time.perf_counter() - started)
                        self.metrics.loaded_tokens(tier.name, obj.key.num_tokens)
                        if number and promoted[position]:
                            self._promote(obj, number)
                    yield hits
            except Exception as err:  # a tier fault: its remaining keys are misses
                self.metrics.error(tier.name, "load")
                self._warner.warn(f"load-{tier.name}", f"{tier.name} tier: load failed ({err!r}); treated as a miss")
            finally:
                close = getattr(batches, "close", None)
                if close is not None:  # a caller that stopped early: the tier's reads in flight clean up now
                    close()

    def _promote(self, obj: ChunkObject, tier_number: int) -> None:
        """Put a hit from a slower tier into the faster ones that take hits (the CPU tier), by reference."""
        for tier in self.tiers[:tier_number]:
            if tier.promote_hits:
                self._tier_put(tier, obj)

    # ------------------------------------------------------------ placement instructions
    def evict(self, tier: str, digest: bytes, demote_to: str | None = None) -> None:
        """Drop ``digest`` from ``tier`` as the placement directory decided; first hand it to ``demote_to``."""
        source = next((t for t in self.tiers if t.name == tier), None)
        if source is None:
            return
        if demote_to is not None:
            target = next((t for t in self.tiers if t.name == demote_to), None)
            if target is not None:
                obj = source.peek(digest)
                if obj is not None:
                    try:
                        self._tier_put(target, obj)
                    finally:
                        obj.release()
        if source.remove(digest):
            self.metrics.evicted(source.name, 1)

    # ------------------------------------------------------------ events
    def _on_dropped(self, digest: bytes) -> None:
        """A persistent tier lost an entry on its own (damaged, unreadable, its filesystem filled up)."""
        self._event(self._dropped_events, TierEvent("disk", digest))

    def _event(self, events: list[TierEvent], event: TierEvent) -> None:
        with self._events_lock:
            events.append(event)

    def drain_events(self) -> tuple[list[TierEvent], list[TierEvent]]:
        """Entries stored into local tiers, and entries local tiers lost on their own, since the last call."""
        with self._events_lock:
            stored, dropped = self._stored_events, self._dropped_events
            self._stored_events, self._dropped_events = [], []
        return stored, dropped

    # ------------------------------------------------------------ housekeeping
    def flush(self, timeout_s: float = 30.0) -> None:
        for tier in self.tiers:
            if not tier.flush(timeout_s):
                logger.warning("%s tier: writes still queued after %.1f s", tier.name, timeout_s)

    def clear(self) -> None:
        dropped: list[TierEvent] = []  # behind the directory's back (tools, tests): reported like a loss
        for tier in self.tiers:
            dropped.extend(TierEvent(tier.name, d) for d in tier.digests())  # a shared store lists nothing
            tier.clear()
        with self._events_lock:
            self._dropped_events.extend(dropped)

    def stats(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = dict(self.metrics.snapshot())
        for tier in self.tiers:
            stats.update(tier.stats())
        return stats

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tier in reversed(self.tiers):  # writers first: they may still read CPU-tier buffers
            try:
                tier.close()
            except Exception as err:  # noqa: BLE001 - close the others anyway
                logger.warning("%s tier: close failed (%s)", tier.name, err)
        self.allocator.trim()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _placement_name(tier: Tier) -> str:
    """The tier's name in the placement directory's instructions: the shared store is "remote" whatever it runs on
    (its metrics say "redis" or "s3"); the peer tier is "peer" (its sources add which peer: ``peer@H:P``)."""
    return tier.name if tier.local or tier.name == PEER else REMOTE


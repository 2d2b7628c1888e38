"""CacheEngine: lookup / store / retrieve of KV chunks over the CPU and disk tiers (vLLM worker process).

Orchestration only: the tiers own bytes and budgets, ``chunk_hashing`` makes
keys, ``chunk_format`` defines the object bytes. The engine never raises to
its caller for a cache fault: a fault is a miss (or a refused store), a
rate-limited warning and a metric, and wrong bytes are never returned.

Contract (the vLLM connector builds on exactly this; extend, don't change):

- ``CacheEngine(config, *, metrics=None, rank_label="0", pin_memory=None)``
- ``lookup(keys) -> int``: tokens of the longest prefix of ``keys`` present in
  some tier (``keys[i-1].end`` of the first miss, tiers walked in order);
  0 when shorter than ``config.min_retrieve_tokens``.
- ``lookup_tokens(tokens, namespace) -> int``: the same from token ids (a
  trailing partial chunk counts when ``save_unfull_chunk`` is on).
- ``keys_for(tokens, namespace) -> list[ChunkKey]``: the keys lookup_tokens uses.
- ``contains(key) -> str | None``: the name of the first tier holding it.
- ``store(key, data) -> bool``: ``data`` is a contiguous CPU tensor of any
  shape/dtype; the engine copies it (the caller may reuse its buffer) and
  never waits for disk I/O. False if refused (full, dropped, bad input).
- ``retrieve(key, out=None) -> Tensor | None``: verified data with the stored
  shape/dtype (copied into ``out`` when given: same dtype and byte size), or
  None on a miss. After a None, ``out`` may hold garbage (disk reads land in
  it directly): use it only when the result is not None. A disk hit is
  promoted into the CPU tier (a remote hit too, by a background thread;
  ``flush`` waits for it).
- ``retrieve_many(keys, outs=None) -> list[Tensor | None]``: ``retrieve`` of
  each key, disk reads in parallel (one file per chunk needs several reads in
  flight to match a sequential stream); results in key order.
- ``stage_remote(keys) -> int``: fetch the chunks among ``keys`` the local
  tiers lack from the remote store in one batched round trip, for the
  ``retrieve`` calls that follow (the connector calls it once per load step).
- ``drain_events() -> (stored, removed)``: digests newly present in some tier
  and digests no longer in any tier since the last call (for the scheduler's
  index; a hint, since a race can make an entry stale: loads stay verified).
- ``flush(timeout_s=30.0)``: wait for queued disk writes. ``clear()``,
  ``stats() -> dict``, ``close()``.
- ``scan_persisted_digests(config, replica=0, world_size=None) -> set[bytes]``:
  digests of the disk tier's files by name, without reading them (the
  scheduler calls it at start-up), over the ranks of one data-parallel replica
  below ``world_size``. Files live in ``<dir>/rank<rank_label>/<hex[:2]>/<hex>.lmc``:
  every rank of every replica has its own subdirectory, budget and index
  (``tiers/disk_ranks``).

CPU-to-disk feeding (``extra_config.disk_feed``): ``write_through`` (default)
queues every stored chunk for disk at once, so a restart or crash loses at
most the queue and the scheduler's index of disk contents stays accurate;
``demote`` writes a chunk only when the CPU tier evicts it. See the README's
benchmark section for the measured trade-off.

Remote tier (``remote_url``, ``lmi_cache.remote``): every newly stored chunk is
also offered to the remote store's bounded queue (never waited for); a load
that misses CPU and disk reads the remote store, verifies the value (header,
checksum, MAC) and promotes it into the CPU tier. A remote miss or fault is a
miss (the connector's load-error path recomputes it).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

from lmi_cache.chunk_format import HEADER_BYTES, ChunkHeader, unpack_header
from lmi_cache.chunk_hashing import ChunkKey, KeyNamespace, chunk_keys
from lmi_cache.config import CacheConfig
from lmi_cache.config_remote import remote_settings
from lmi_cache.eviction.base import make_policy
from lmi_cache.metrics import CacheMetrics, RateLimitedWarner
from lmi_cache.tiers import disk_io
from lmi_cache.tiers.buffers import copy_bytes, copy_payload_out, dtype_name, torch_dtype
from lmi_cache.tiers.cpu_tier import CpuEntry, CpuTier, PayloadFill
from lmi_cache.tiers.disk_ranks import replica_rank_dirs
from lmi_cache.tiers.disk_tier import DiskTier, scan_persisted_digests_in
from lmi_cache.tiers.factory import create_tier

logger = logging.getLogger(__name__)


class CacheEngine:
    def __init__(
        self,
        config: CacheConfig,
        *,
        metrics: CacheMetrics | None = None,
        rank_label: str = "0",
        pin_memory: bool | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else CacheMetrics(rank_label)
        self._warner = RateLimitedWarner(logger)
        self._events_lock = threading.Lock()
        self._stored_events: list[bytes] = []
        self._removed_events: list[bytes] = []
        self._closed = False
        self._read_pool: ThreadPoolExecutor | None = None
        self._promote_pool: ThreadPoolExecutor | None = None
        has_disk = config.disk_capacity_bytes > 0
        self._cpu: CpuTier | None = None  # set before the disk tier: its start-up may call back
        self._disk: DiskTier | None = None
        if has_disk:
            disk = create_tier(
                "disk", rank_disk_dirs(config, rank_label), config.disk_capacity_bytes, metrics=self.metrics,
                warner=self._warner, policy_name=config.cache_policy, use_odirect=config.use_odirect,
                fsync=config.disk_fsync, num_workers=config.disk_write_workers,
                queue_depth=config.disk_queue_depth, on_remove=self._on_disk_removed,
            )
            assert isinstance(disk, DiskTier)
            self._disk = disk
        self._demote = has_disk and config.disk_feed == "demote"
        self._write_through = has_disk and not self._demote
        if config.cpu_capacity_bytes > 0:
            cpu = create_tier(
                "cpu", config.cpu_capacity_bytes, make_policy(config.cache_policy), metrics=self.metrics,
                warner=self._warner, pin_memory=pin_memory, on_evict=self._on_cpu_evict,
                keep_evicted_buffers=self._demote,
            )
            assert isinstance(cpu, CpuTier)
            self._cpu = cpu
        self._remote: Any = None  # lmi_cache.remote.tier.RemoteTier, imported only when configured
        settings = remote_settings(config)
        if settings is not None:
            from lmi_cache.remote.tier import RemoteTier

            self._remote = RemoteTier(settings, metrics=self.metrics, warner=self._warner)

    # ------------------------------------------------------------ lookup
    def keys_for(self, tokens: Sequence[int] | np.ndarray, namespace: KeyNamespace) -> list[ChunkKey]:
        return chunk_keys(tokens, namespace, self.config.chunk_size, include_partial=self.config.save_unfull_chunk)

    def contains(self, key: ChunkKey) -> str | None:
        if self._cpu is not None and self._cpu.contains(key.digest):
            return self._cpu.name
        if self._disk is not None and self._disk.contains(key.digest):
            return self._disk.name
        return None

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        # Not a metric: under vLLM prompts are looked up (and counted) by the scheduler, not here.
        hit_tokens = 0
        for key in keys:
            if self.contains(key) is None:
                break
            hit_tokens = key.end
        return hit_tokens if hit_tokens >= self.config.min_retrieve_tokens else 0

    def lookup_tokens(self, tokens: Sequence[int] | np.ndarray, namespace: KeyNamespace) -> int:
        return self.lookup(self.keys_for(tokens, namespace))

    # ------------------------------------------------------------ store
    def store(self, key: ChunkKey, data: torch.Tensor) -> bool:
        try:
            if data.device.type != "cpu" or not data.is_contiguous():
                raise ValueError("store() takes a contiguous CPU tensor")
            payload = data.detach().reshape(-1).view(torch.uint8)
            header = ChunkHeader.for_key(key, int(payload.numel()), dtype_name(data.dtype), tuple(data.shape))
            return self._store(key, header, payload)
        except Exception as err:  # the failure policy: never raise into vLLM
            self.metrics.dropped("engine", "error")
            self._warner.warn("store", f"cache store failed ({err!r}); chunk not cached")
            return False

    def store_from(self, key: ChunkKey, shape: tuple[int, ...], dtype: torch.dtype, fill: PayloadFill) -> bool:
        """Like ``store``, but ``fill(out)`` writes the chunk straight into engine memory.

        ``out`` is a CPU tensor of ``shape``/``dtype``; the connector gathers KV
        blocks into it, saving the copy through a staging buffer (the save is on
        vLLM's critical path). ``fill`` is not called when the CPU tier already
        holds the chunk. A ``fill`` that raises makes a refused store, never an entry.
        """
        try:
            num_bytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            header = ChunkHeader.for_key(key, num_bytes, dtype_name(dtype), tuple(shape))
            return self._store(key, header, fill)
        except Exception as err:  # the failure policy: never raise into vLLM
            self.metrics.dropped("engine", "error")
            self._warner.warn("store", f"cache store failed ({err!r}); chunk not cached")
            return False

    def _store(self, key: ChunkKey, header: ChunkHeader, payload: torch.Tensor | PayloadFill) -> bool:
        was_present = self.contains(key) is not None
        stored = False
        obj: np.ndarray | None = None  # header + payload, for the remote tier
        if self._cpu is not None:
            entry = self._cpu.put(key, header, payload, pin=self._write_through)
            if entry is not None:
                stored = True
                obj = entry.buffer[: entry.header.total_bytes].numpy()
                if self._write_through and self._disk is not None:
                    self._disk.put(key, entry.header, _payload_array(entry), release=lambda: self._unpin(entry),
                                   object_buffer=entry.buffer.numpy())
        if not stored and self._disk is not None:
            # No CPU tier (or it is full of pinned entries): the disk writer needs its own copy.
            disk_obj = disk_io.aligned_buffer(header.total_bytes)  # aligned: O_DIRECT writes it as is
            target = torch.from_numpy(disk_obj[HEADER_BYTES : header.total_bytes])
            if isinstance(payload, torch.Tensor):
                copy_bytes(target, payload)
            else:
                payload(target.view(torch_dtype(header.dtype)).view(header.shape))
            stored = self._disk.put(key, header, disk_obj[HEADER_BYTES : header.total_bytes], object_buffer=disk_obj)
            obj = disk_obj[: header.total_bytes]
        if stored and not was_present:
            with self._events_lock:
                self._stored_events.append(key.digest)
        if self._remote is not None and not was_present:
            if obj is None:  # no local tier took it: the remote queue copies it from a scratch object
                obj = np.empty(header.total_bytes, dtype=np.uint8)
                obj[:HEADER_BYTES] = np.frombuffer(header.pack(), dtype=np.uint8)
                target = torch.from_numpy(obj[HEADER_BYTES:])
                if isinstance(payload, torch.Tensor):
                    copy_bytes(target, payload)
                else:
                    payload(target.view(torch_dtype(header.dtype)).view(header.shape))
            stored = self._remote.offer(key, obj) or stored
        return stored

    def _unpin(self, entry: CpuEntry) -> None:
        if self._cpu is not None:
            self._cpu.unpin(entry)

    # ------------------------------------------------------------ retrieve
    def retrieve(self, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        try:
            return self._retrieve(key, out)
        except Exception as err:
            self.metrics.error("engine", "load")
            self._warner.warn("retrieve", f"cache load failed ({err!r}); treated as a miss")
            return None

    def _retrieve(self, key: ChunkKey, out: torch.Tensor | None) -> torch.Tensor | None:
        start_s = time.perf_counter()
        if self._cpu is not None:
            result = self._cpu.load(key, out)
            if result is not None:
                self.metrics.loaded("cpu", time.perf_counter() - start_s)
                self.metrics.loaded_tokens("cpu", key.num_tokens)
                return result
        result = self._retrieve_disk(key, out) if self._disk is not None else None
        if result is None and self._remote is not None:
            return self._retrieve_remote(key, out)
        return result

    def _retrieve_disk(self, key: ChunkKey, out: torch.Tensor | None) -> torch.Tensor | None:
        assert self._disk is not None
        if out is not None and out.device.type == "cpu" and out.is_contiguous():
            return self._retrieve_disk_into(key, out)
        # With ``out`` (on a GPU) the bytes are copied anyway: read into a warm per-thread buffer.
        obj = self._disk.load_object(key, scratch=out is not None)
        if obj is None:
            return None
        header = unpack_header(obj)
        obj_tensor = torch.from_numpy(obj)
        if self._cpu is not None:
            self._cpu.put(key, header, obj_tensor[HEADER_BYTES : header.total_bytes])  # promotion
        result = copy_payload_out(obj_tensor, header, out) if out is not None else _view_payload(obj_tensor, header)
        self.metrics.loaded_tokens("disk", key.num_tokens)
        return result

    def retrieve_many(
        self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor | None] | None = None
    ) -> list[torch.Tensor | None]:
        targets: Sequence[torch.Tensor | None] = outs if outs is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ValueError("retrieve_many: outs must match keys one to one")
        if self._disk is None or len(keys) <= 1:
            return [self.retrieve(key, out) for key, out in zip(keys, targets)]
        with self._events_lock:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(self.config.disk_read_workers, thread_name_prefix="lmi-disk-reader")
        futures = [self._read_pool.submit(self.retrieve, key, out) for key, out in zip(keys, targets)]
        return [future.result() for future in futures]

    def _retrieve_remote(self, key: ChunkKey, out: torch.Tensor | None) -> torch.Tensor | None:
        from lmi_cache.remote.tier import fill_from

        chunk = self._remote.take(key)
        if chunk is None:
            return None
        result = fill_from(chunk, out)
        if self._cpu is not None:
            # Promotion (later loads of this chunk stay local) off the load's critical path: it copies
            # from the fetched value, which nothing else holds, into fresh CPU-tier memory.
            with self._events_lock:
                if self._promote_pool is None:
                    self._promote_pool = ThreadPoolExecutor(1, thread_name_prefix="lmi-remote-promote")
            self._promote_pool.submit(self._promote, key, chunk)
        self.metrics.loaded_tokens(self._remote.name, key.num_tokens)
        return result

    def _promote(self, key: ChunkKey, chunk: Any) -> None:
        try:
            assert self._cpu is not None
            source = np.frombuffer(chunk.payload, dtype=np.uint8)
            fill = lambda out: np.copyto(out.reshape(-1).view(torch.uint8).numpy(), source)  # noqa: E731
            if self._cpu.put(key, chunk.header, fill) is not None:
                with self._events_lock:
                    self._stored_events.append(key.digest)
        except Exception as err:  # a failed promotion is only a later remote load
            self._warner.warn("promote", f"remote chunk not promoted into the CPU tier ({err!r})")

    def stage_remote(self, keys: Sequence[ChunkKey]) -> int:
        """One batched remote read of the chunks among ``keys`` no local tier holds; how many were found."""
        if self._remote is None:
            return 0
        try:
            return int(self._remote.stage([k for k in keys if self.contains(k) is None]))
        except Exception as err:  # the failure policy: the loads that follow fetch one by one or miss
            self._warner.warn("stage", f"remote prefetch failed ({err!r}); loads fetch chunk by chunk")
            return 0

    def _retrieve_disk_into(self, key: ChunkKey, out: torch.Tensor) -> torch.Tensor | None:
        assert self._disk is not None
        out_bytes = out.detach().reshape(-1).view(torch.uint8)
        header = self._disk.load_into(key, out_bytes.numpy())
        if header is None:
            return None
        if torch_dtype(header.dtype) != out.dtype:
            raise ValueError(f"out has dtype {out.dtype}, the stored chunk {header.dtype}")
        if self._cpu is not None:
            self._cpu.put(key, header, out_bytes)  # promotion
        self.metrics.loaded_tokens("disk", key.num_tokens)
        return out

    # ------------------------------------------------------------ events
    def _on_cpu_evict(self, entry: CpuEntry) -> None:
        digest = entry.digest
        if self._demote and self._disk is not None:
            header = entry.header
            key = ChunkKey(digest, header.start, header.end, header.fingerprint)
            # The tier gave up this buffer (keep_evicted_buffers): the writer holds it, then hands it back.
            cpu = self._cpu
            release = (lambda: cpu.recycle(entry.buffer)) if cpu is not None else None
            if self._disk.put(key, header, _payload_array(entry), release=release, object_buffer=entry.buffer.numpy()):
                return
        if self._disk is None or not self._disk.contains(digest):
            with self._events_lock:
                self._removed_events.append(digest)

    def _on_disk_removed(self, digest: bytes) -> None:
        if self._cpu is None or not self._cpu.contains(digest):
            with self._events_lock:
                self._removed_events.append(digest)

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        with self._events_lock:
            stored, removed = self._stored_events, self._removed_events
            self._stored_events, self._removed_events = [], []
        return stored, removed

    # ------------------------------------------------------------ housekeeping
    def flush(self, timeout_s: float = 30.0) -> None:
        if self._disk is not None and not self._disk.flush(timeout_s):
            logger.warning("disk tier: %d writes still queued after %.1f s", self._disk.queued_writes, timeout_s)
        if self._remote is not None and not self._remote.flush(timeout_s):
            logger.warning("remote tier: stores still queued after %.1f s", timeout_s)
        if self._promote_pool is not None:  # promotions run in order: wait for the last one queued
            self._promote_pool.submit(lambda: None).result(timeout_s)

    def clear(self) -> None:
        digests: set[bytes] = set()
        for tier in (self._cpu, self._disk):
            if tier is not None:
                digests.update(tier.digests())
                tier.clear()
        with self._events_lock:
            self._removed_events.extend(digests)

    def stats(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = dict(self.metrics.snapshot())
        if self._cpu is not None:
            stats["cpu_entries"] = len(self._cpu.digests())
            stats["cpu_used_bytes"] = self._cpu.used_bytes
            stats["cpu_capacity_bytes"] = self._cpu.capacity_bytes
        if self._disk is not None:
            stats["disk_entries"] = len(self._disk.digests())
            stats["disk_used_bytes"] = self._disk.used_bytes
            stats["disk_capacity_bytes"] = self._disk.capacity_bytes
            stats["disk_queued_writes"] = self._disk.queued_writes
        if self._remote is not None:
            stats.update(self._remote.stats())
        return stats

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=True)
        if self._promote_pool is not None:
            self._promote_pool.shutdown(wait=True)
        if self._disk is not None:
            self._disk.close()
        if self._remote is not None:
            self._remote.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _payload_array(entry: CpuEntry) -> np.ndarray:
    return entry.buffer[HEADER_BYTES : entry.header.total_bytes].numpy()


def _view_payload(obj: torch.Tensor, header: ChunkHeader) -> torch.Tensor:
    """The payload of a freshly read object as the stored tensor, without a copy (the caller owns it)."""
    payload = obj[HEADER_BYTES : header.total_bytes]
    return payload.view(torch_dtype(header.dtype)).reshape(header.shape)


def rank_disk_dirs(config: CacheConfig, rank_label: str) -> list[str]:
    """This rank's disk-tier directories: ``<dir>/rank<label>`` under each configured path.

    Ranks on one host share the configured paths, but each rank has its own
    budget (GiB per rank) and index, so each gets its own subdirectory. The
    connector labels ranks of data-parallel replicas > 0 ``<rank>-dp<replica>``
    (``disk_ranks.rank_label``).
    """
    return [os.path.join(root, f"rank{rank_label}") for root in config.local_disk]


def scan_persisted_digests(config: CacheConfig, replica: int = 0, world_size: int | None = None) -> set[bytes]:
    """Digests of one replica's object files, by file name only (scheduler process, start-up).

    Only ranks below ``world_size`` (all when None) and only directories and
    files that are ours count: digests no worker of this replica can serve
    must not make the scheduler promise hits.
    """
    if config.disk_capacity_bytes <= 0:
        return set()
    return scan_persisted_digests_in(replica_rank_dirs(config.local_disk, replica, world_size))

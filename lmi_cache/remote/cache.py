"""RemoteCache: the never-blocking client of a remote store, in verified chunks (vLLM worker process).

The middle of the remote path, between ``RemoteTier`` (the engine's tier
protocol: ``get_many`` / ``put`` / ``contains``) and ``RemoteStore`` (bytes by
name: ``exists_many`` / ``fetch_many`` / ``upload_many``). It speaks chunks
by ``ChunkKey``, encoded and verified by ``ValueCodec``, and turns every store
fault into a miss: ``has_many`` (one batched EXISTS or HEAD round trip,
bounded by ``lookup_timeout_ms``; ``has_many_async`` returns a
``PendingLookup`` to poll instead, for vLLM's scheduler, which may answer
"not yet" and ask again on a later step), ``read_many`` (one batched GET,
bounded by ``io_timeout_ms``, received into memory the caller gives
(``read_many_into``: the tier's host allocator, so a value needs no copy after
it arrives); values verified by ``ValueCodec``) and ``write`` (queued for a
background writer; a full queue drops the chunk and counts it, so the caller
never waits on the network). Calls run on a small I/O pool
and the caller waits at most the timeout: a slow or hung store turns into
misses, one rate-limited warning per outage and counters, while ``Backoff``
keeps calls off the store until a growing delay has passed. Nothing here
raises to the caller after construction.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence, TypeVar

from lmi_cache.keys.chunk_format import BytesLike
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.remote.put_queue import Batch, PutQueue
from lmi_cache.remote.settings import RemoteSettings
from lmi_cache.remote.store import Backoff, BodyAllocator, ReceivedValue, RemoteStore, StoreError
from lmi_cache.remote.value_codec import VALUE_HEADER_BYTES, DecodedChunk, MissReason, ValueCodec
from lmi_cache.thread_affinity import unpin_current_thread

logger = logging.getLogger(__name__)
T = TypeVar("T")
_PARALLEL_DECODE_BYTES = 4 << 20
# Decode faults counted as corrupted reads; the others of MissReason are counted as tier errors.
_CORRUPTED = {MissReason.CORRUPTED, MissReason.TRUNCATED}


class RemoteCache:
    """Batched lookups, verified loads and asynchronous stores against one ``RemoteStore``."""

    def __init__(
        self,
        store: RemoteStore,
        codec: ValueCodec,
        settings: RemoteSettings,
        *,
        metrics: CacheMetrics | None = None,
        warner: RateLimitedWarner | None = None,
        io_threads: int = 4,
    ) -> None:
        self.store = store
        self.codec = codec
        self.settings = settings
        self.name = store.name
        self._metrics = metrics
        self._warner = warner if warner is not None else RateLimitedWarner(logger)
        self._backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s)
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="lmi-cache-remote-io",
                                      initializer=unpin_current_thread)
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._closed = False
        self._decode_pool: ThreadPoolExecutor | None = None
        self._decode_pool_lock = threading.Lock()
        self._puts = PutQueue(self._upload_batch, settings.put_queue_bytes)
        self._io.submit(self._warm_up)  # not waited for: a store that is down costs nothing here

    # ------------------------------------------------------------ lookups and reads
    def has_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Which keys the store holds now; all False when it is down, slow or backing off."""
        if not keys:
            return []
        self._count("lookups")
        names = [self.store.name_for(k.digest) for k in keys]
        found = self._call("lookup", self.store.exists_many, names, self.settings.lookup_timeout_ms)
        if isinstance(found, MissReason) or len(found) != len(keys):
            return [False] * len(keys)
        self._count("lookup_hits", sum(found))
        return found

    def has_many_async(self, keys: Sequence[ChunkKey]) -> PendingLookup:
        """``has_many`` without waiting: poll the result (vLLM's scheduler may ask again next step)."""
        self._count("lookups")
        names = [self.store.name_for(k.digest) for k in keys]
        future = self._submit("lookup", self.store.exists_many, names) if keys else MissReason.UNAVAILABLE
        return PendingLookup(self, future, len(keys), time.monotonic() + self.settings.lookup_timeout_ms / 1000)

    def read_many(self, keys: Sequence[ChunkKey]) -> list[DecodedChunk | MissReason]:
        """Verified chunks in key order, or the reason each one is a miss (values in fresh memory)."""
        return [result for result, _ in self.read_many_into(keys, _fresh_memory)]

    def read_many_into(
        self, keys: Sequence[ChunkKey], allocate: BodyAllocator
    ) -> list[tuple[DecodedChunk | MissReason, Any]]:
        """``read_many`` with each value received into memory from ``allocate``: (result, owner) in key order.

        ``owner`` is what ``allocate`` gave for that value's body (None when nothing was
        given); with an ``in_place`` result it holds the chunk object (chunk header and
        payload), ready to adopt without a copy. The caller recycles every owner it does
        not adopt. After a timeout the late reply's memory is left to the garbage collector:
        the I/O thread may still be writing into it.
        """
        if not keys:
            return []
        names = [self.store.name_for(k.digest) for k in keys]

        def fetch(batch: Sequence[str]) -> list[ReceivedValue | None]:
            return self.store.fetch_many_into(batch, VALUE_HEADER_BYTES, allocate)

        received = self._call("get", fetch, names, self.settings.io_timeout_ms)
        if isinstance(received, MissReason) or len(received) != len(keys):
            return [(miss, None) for miss in self._all_missed(received, len(keys))]
        results = self._counted(self._decode_all(received, keys))
        return [(result, None if value is None else value.owner) for result, value in zip(results, received)]

    def _all_missed(self, failed: object, num_keys: int) -> list[DecodedChunk | MissReason]:
        reason = failed if isinstance(failed, MissReason) else MissReason.UNAVAILABLE
        self._count(f"miss_{reason.value}", num_keys)
        return [reason] * num_keys

    def _counted(self, results: list[DecodedChunk | MissReason]) -> list[DecodedChunk | MissReason]:
        for result in results:  # load latency and tokens are the engine's metrics (per tier, all alike)
            if isinstance(result, DecodedChunk):
                self._count("get_hits")
                self._count("get_bytes", len(result.payload))
            else:
                self._count(f"miss_{result.value}")
                self._record_bad_value(result)
        return results

    def _warm_up(self) -> None:
        try:
            self.store.warm_up()
        except Exception:  # the first real call reports it (once) and backs off
            pass

    def _decode_all(
        self, values: Sequence[ReceivedValue | None], keys: Sequence[ChunkKey]
    ) -> list[DecodedChunk | MissReason]:
        """Decode (MAC, decompression, checksum) in parallel when a batch is large: zstd and BLAKE3 drop the GIL."""
        total_bytes = sum(len(v.body) for v in values if v is not None)
        if len(values) < 2 or total_bytes < _PARALLEL_DECODE_BYTES:
            return [self._decode_one(value, key) for value, key in zip(values, keys)]
        with self._decode_pool_lock:
            if self._decode_pool is None:
                self._decode_pool = ThreadPoolExecutor(
                    max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="lmi-cache-remote-decode",
                    initializer=unpin_current_thread,
                )
            pool = self._decode_pool
        try:
            return list(pool.map(self._decode_one, values, keys))
        except RuntimeError:  # closed meanwhile: decode here (decode itself never raises)
            return [self._decode_one(value, key) for value, key in zip(values, keys)]

    def _decode_one(self, value: ReceivedValue | None, key: ChunkKey) -> DecodedChunk | MissReason:
        return MissReason.NOT_FOUND if value is None else self.codec.decode_parts(value.head, value.body, key)

    def _record_bad_value(self, reason: MissReason) -> None:
        if reason == MissReason.NOT_FOUND:
            return
        self._warner.warn(f"remote-value-{reason.value}", f"{self.name}: a remote value was refused "
                          f"({reason.value}); it is a miss")
        if self._metrics is None:
            return
        if reason in _CORRUPTED:
            self._metrics.corrupted(self.name)
        elif reason == MissReason.FINGERPRINT:
            self._metrics.fingerprint_mismatch(self.name)
        else:
            self._metrics.error(self.name, reason.value)

    def _call(self, op: str, fn: Callable[[Any], T], arg: Any, timeout_ms: int) -> T | MissReason:
        """``fn(arg)`` on the I/O pool, waited for at most ``timeout_ms``; a MissReason on any fault."""
        future = self._submit(op, fn, arg)
        if isinstance(future, MissReason):
            return future
        try:
            future.result(timeout=timeout_ms / 1000)
        except Exception:  # settled below, once
            pass
        return self._settle(op, future, timeout_ms)

    def _submit(self, op: str, fn: Callable[[Any], T], arg: Any) -> Future[T] | MissReason:
        if self._closed or not self._backoff.allow():
            self._count(f"{op}_skipped_backoff")
            return MissReason.UNAVAILABLE
        try:
            return self._io.submit(fn, arg)
        except RuntimeError as err:  # the pool was shut down by close()
            self._fault(op, err)
            return MissReason.UNAVAILABLE

    def _settle(self, op: str, future: Future[T], timeout_ms: int) -> T | MissReason:
        """The outcome of a call whose time is up: its result, or a fault (counted, backed off)."""
        if not future.done():
            self._fault(op, StoreError(f"{self.name} {op} took longer than {timeout_ms} ms", timeout=True))
            return MissReason.TIMEOUT
        try:
            result = future.result(timeout=0)
        except Exception as err:  # StoreError (or a cancelled future at close)
            self._fault(op, err)
            return MissReason.TIMEOUT if isinstance(err, StoreError) and err.timeout else MissReason.UNAVAILABLE
        if self._backoff.succeeded():
            logger.info("%s store %s answers again", self.name, self.settings.display_url)
        return result

    def _fault(self, op: str, err: BaseException) -> None:
        timeout = isinstance(err, StoreError) and err.timeout
        self._count(f"{op}_{'timeouts' if timeout else 'errors'}")
        if self._metrics is not None:
            self._metrics.error(self.name, f"{op}_timeout" if timeout else op)
        if self._backoff.failed():
            self._warner.warn(
                "remote-down",
                f"{self.name} store {self.settings.display_url} is not answering ({err}); remote lookups are "
                "misses and stores are dropped until it answers again",
            )

    # ------------------------------------------------------------ writes
    def write(self, key: ChunkKey, obj: BytesLike) -> bool:
        """Queue a chunk object for the store; False (counted) when dropped. Never waits on the network."""
        reason = "closed" if self._closed else None if self._backoff.allow() else "unavailable"
        reason = reason or self._puts.offer(key, obj)
        if reason is not None:
            self._drop(reason)
            return False
        self._count("puts_queued")
        return True

    def _drop(self, reason: str, num: int = 1) -> None:
        self._count(f"puts_dropped_{reason}", num)
        if self._metrics is not None:
            for _ in range(num):
                self._metrics.dropped(self.name, reason)

    def _upload_batch(self, batch: Batch) -> None:
        """The writer thread's callback: encode, store in one batch, count; never raises."""
        items: list[tuple[str, bytes]] = []
        tokens: list[int] = []
        for key, obj in batch:
            try:
                items.append((self.store.name_for(key.digest), self.codec.encode(obj, key)))
                tokens.append(key.num_tokens)
            except Exception as err:  # a malformed object: refuse it, keep the rest
                self._drop("error")
                self._warner.warn("remote-encode", f"{self.name}: a chunk could not be encoded ({err}); not stored")
        if not items:
            return
        if not self._backoff.allow():
            self._drop("unavailable", len(items))
            return
        started = time.perf_counter()
        try:
            self.store.upload_many(items)
        except Exception as err:
            self._drop("error", len(items))
            self._fault("put", err)
            return
        if self._backoff.succeeded():
            logger.info("%s store %s answers again", self.name, self.settings.display_url)
        seconds = time.perf_counter() - started
        self._count("puts_stored", len(items))
        self._count("put_bytes", sum(len(v) for _, v in items))
        if self._metrics is not None:
            for (_, value), num_tokens in zip(items, tokens):
                self._metrics.stored(self.name, num_tokens, len(value), seconds / len(items))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued writes reach the store (or are dropped); False on timeout."""
        return self._puts.flush(timeout_s)

    # ------------------------------------------------------------ housekeeping
    def ping(self, timeout_s: float = 1.0) -> str | None:
        """None when the store answers within ``timeout_s``; otherwise why not (safe to print)."""
        future = self._io.submit(self.store.ping)
        try:
            future.result(timeout=timeout_s)
            return None
        except FutureTimeout:
            return f"{self.name} store {self.settings.display_url} did not answer within {timeout_s:g} s"
        except Exception as err:
            return f"{self.name} store {self.settings.display_url} did not answer ({err})"

    def _count(self, name: str, amount: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] += amount

    def stats(self) -> dict[str, int]:
        with self._counts_lock:
            counts = dict(self._counts)
        counts["queued_puts"], counts["queued_bytes"] = self._puts.depth()
        counts["reconnects"] = self._backoff.reconnects
        counts["down"] = int(self._backoff.is_down)
        return counts

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Write what is queued (for at most ``flush_timeout_s``), then stop threads and the client."""
        if self._closed:
            return
        self.flush(flush_timeout_s)
        self._closed = True
        discarded = self._puts.close()
        if discarded:
            self._drop("closed", discarded)
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._decode_pool is not None:
            self._decode_pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()


def _fresh_memory(num_bytes: int) -> tuple[bytearray, memoryview]:
    buffer = bytearray(num_bytes)
    return buffer, memoryview(buffer)


class PendingLookup:
    """An existence check in flight; ``poll`` never blocks and settles at most once."""

    def __init__(self, cache: RemoteCache, future: Future[list[bool]] | MissReason, num_keys: int,
                 deadline: float) -> None:
        self._cache = cache
        self._future = future
        self._num_keys = num_keys
        self._deadline = deadline
        self._result: list[bool] | None = None if isinstance(future, Future) else [False] * num_keys
        # "answered", or the MissReason value of why the check gave nothing (timeout, unavailable).
        self.outcome: str = "answered" if isinstance(future, Future) else future.value

    def poll(self) -> list[bool] | None:
        """Which keys the store holds, or None while the check is in flight and within the lookup timeout."""
        if self._result is not None:
            return self._result
        assert isinstance(self._future, Future)
        if not self._future.done() and time.monotonic() < self._deadline:
            return None
        found = self._cache._settle("lookup", self._future, self._cache.settings.lookup_timeout_ms)
        if isinstance(found, MissReason) or len(found) != self._num_keys:
            self._result = [False] * self._num_keys
            self.outcome = found.value if isinstance(found, MissReason) else MissReason.UNAVAILABLE.value
        else:
            self._cache._count("lookup_hits", sum(found))
            self._result = found
        return self._result

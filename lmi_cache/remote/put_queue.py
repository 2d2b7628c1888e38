"""A byte-bounded queue of chunk objects drained by one background writer thread (vLLM worker process).

``offer`` never blocks on the writer: a value that does not fit is refused
with a reason, so the serving path never waits on the network. The writer
hands batches (at most ``batch_values`` values / ``batch_bytes`` bytes) to a
callback that must not raise; ``flush`` waits until the queue is empty and
no batch is in flight; ``close`` stops the writer and returns what it left.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from lmi_cache.keys.chunk_format import BytesLike, byte_view
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.thread_affinity import unpin_current_thread

logger = logging.getLogger(__name__)
Batch = list[tuple[ChunkKey, bytes]]


class PutQueue:
    def __init__(self, write_batch: Callable[[Batch], None], max_bytes: int, *, batch_values: int = 16,
                 batch_bytes: int = 64 << 20, thread_name: str = "lmi-cache-remote-writer") -> None:
        self._write_batch = write_batch
        self._max_bytes = max_bytes
        self._batch_values = batch_values
        self._batch_bytes = batch_bytes
        self._queue: deque[tuple[ChunkKey, bytes]] = deque()
        self._queued_bytes = 0
        self._in_flight = 0
        self._closed = False
        self._cond = threading.Condition()
        self._writer = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._writer.start()

    def offer(self, key: ChunkKey, obj: BytesLike) -> str | None:
        """Queue a copy of ``obj`` (the caller may reuse its buffer); None, or why it was refused."""
        size = len(byte_view(obj))
        with self._cond:
            if self._closed:
                return "closed"
            if self._queued_bytes + size > self._max_bytes:
                return "queue_full"
            self._queued_bytes += size  # reserved: the copy below happens outside the lock
        owned = obj if isinstance(obj, bytes) else bytes(byte_view(obj))
        with self._cond:
            if self._closed:
                self._queued_bytes -= size
                return "closed"
            self._queue.append((key, owned))
            self._cond.notify()
        return None

    def _loop(self) -> None:
        unpin_current_thread()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch: Batch = []
                batch_bytes = 0
                while self._queue and len(batch) < self._batch_values and batch_bytes < self._batch_bytes:
                    item = self._queue.popleft()
                    batch.append(item)
                    batch_bytes += len(item[1])
                self._queued_bytes -= batch_bytes
                self._in_flight = len(batch)
            try:
                self._write_batch(batch)
            except Exception:  # the callback must not raise; if it does, keep the writer alive
                logger.exception("remote store writer: a batch of %d values was lost", len(batch))
            finally:
                with self._cond:
                    self._in_flight = 0
                    self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued value was handed to the writer callback and it returned; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def depth(self) -> tuple[int, int]:
        """(values, bytes) waiting now."""
        with self._cond:
            return len(self._queue), self._queued_bytes

    def close(self, join_timeout_s: float = 1.0) -> int:
        """Stop accepting and writing; returns how many queued values were discarded."""
        with self._cond:
            self._closed = True
            discarded = len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        self._writer.join(timeout=join_timeout_s)
        return discarded

"""Host memory for chunk objects: a size-class allocator and reference-counted objects (worker process).

Every chunk that moves through the engine lives in one ``ChunkObject``: a
page-aligned host buffer holding the object bytes (``keys.chunk_format``: header,
then payload) with a reference count. Tiers do not copy objects between each
other, they take references: the CPU tier adopts the very buffer a save
gathered into (or a disk read landed in), a queued disk write holds it until
the file is written, a load scatters straight from it. When the last
reference goes, the buffer returns to the allocator's warm pool.

Why a pool: a fresh 4 MiB buffer costs ~1,000 page faults on its first write
(measured 1.9 ms vs 0.4 ms into a reused one), and saves and loads sit on
vLLM's critical path. Why page-aligned: the disk tier writes and reads them
with O_DIRECT without a bounce buffer. On a CUDA host buffers are page-locked
("pinned" in CUDA's words; here we say *page-locked* to keep "reference" for
the count) so host <-> device copies run asynchronously at full speed; if
page-locking fails we fall back to pageable memory with one warning.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from lmi_cache.keys.chunk_format import HEADER_BYTES, ChunkHeader
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.thread_affinity import unpin_current_thread
from lmi_cache.tiers.buffers import PAGE_BYTES, size_class_bytes, torch_dtype

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
WARM_QUIET_S = 0.02  # keep_warm refills the pool only after this long without an allocation from it


class ChunkObject:
    """One chunk object in host memory, shared by reference between tiers and transfers.

    ``buffer[:header.total_bytes]`` is the object (header + payload). The
    creator holds the first reference; ``acquire`` adds one, ``release`` drops
    one, and the last release hands the buffer back to the allocator. Readers
    never see a buffer being reused: whoever reads holds a reference.
    """

    __slots__ = ("key", "header", "buffer", "_refs", "_allocator")

    def __init__(self, key: ChunkKey, header: ChunkHeader, buffer: torch.Tensor, allocator: HostAllocator | None) -> None:
        self.key = key
        self.header = header
        self.buffer = buffer  # uint8, size-class bytes, page-aligned
        self._refs = 1
        self._allocator = allocator

    @property
    def class_bytes(self) -> int:
        return int(self.buffer.numel())

    @property
    def refs(self) -> int:
        return self._refs

    def acquire(self) -> ChunkObject:
        with _REFS_LOCK:
            if self._refs <= 0:
                raise RuntimeError("acquire of a released chunk object")
            self._refs += 1
        return self

    def release(self) -> None:
        with _REFS_LOCK:
            self._refs -= 1
            last = self._refs == 0
            if self._refs < 0:
                raise RuntimeError("chunk object released more often than acquired")
        if last and self._allocator is not None:
            self._allocator.recycle(self.buffer)

    def object_array(self) -> np.ndarray:
        """Header + payload bytes (a view)."""
        return self.buffer[: self.header.total_bytes].numpy()

    def payload_array(self) -> np.ndarray:
        """Payload bytes (a view)."""
        return self.buffer[HEADER_BYTES : self.header.total_bytes].numpy()

    def payload_tensor(self) -> torch.Tensor:
        """The payload as a tensor of the stored dtype and shape (a view, no copy)."""
        header = self.header
        return self.buffer[HEADER_BYTES : header.total_bytes].view(torch_dtype(header.dtype)).view(header.shape)

    def write_header(self) -> None:
        self.buffer[:HEADER_BYTES].numpy()[:] = np.frombuffer(self.header.pack(), dtype=np.uint8)


_REFS_LOCK = threading.Lock()  # one lock for all counts: an acquire/release is a few ns under it


class HostAllocator:
    """Page-aligned host buffers in size classes, recycled through a bounded warm pool.

    ``pool_limit_bytes`` bounds the free buffers kept warm; beyond it, freed
    buffers go back to the OS. Thread-safe.
    """

    def __init__(self, *, page_locked: bool | None = None, pool_limit_bytes: int = 256 << 20) -> None:
        self._page_locked = torch.cuda.is_available() if page_locked is None else page_locked
        self._pool_limit = max(0, pool_limit_bytes)
        self._lock = threading.Lock()
        self._pool: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._pooled_bytes = 0
        self._warm_class = 0  # the size class keep_warm keeps ready (0: none)
        self._headroom: Callable[[], int] | None = None  # budget reserved for buffers and not used yet
        self._warm_wanted = threading.Event()
        self._warmer: threading.Thread | None = None
        self._closed = False

    @property
    def pooled_bytes(self) -> int:
        return self._pooled_bytes

    @property
    def page_locked(self) -> bool:
        return self._page_locked

    def set_headroom(self, headroom: Callable[[], int]) -> None:
        """Let the pool grow past its limit into host memory already budgeted for buffers but unused.

        ``headroom()`` is what the tiers that keep buffers (the CPU tier) may still
        take. Until the CPU tier is full, every chunk a save gathers, a disk read
        lands or a remote reply is received into is fresh memory, faulted in on
        vLLM's critical path (a 32M Redis hit's load on the model thread: 152 ms
        per document with fresh buffers, 103-113 ms with this; bench_connector). With
        headroom the warmer touches the tier's whole budget ahead of demand (the
        memory plan counts it already), and buffers freed while the tier has room
        stay warm. The bound is unchanged: tier bytes + pool bytes stay within the
        larger of the tier's budget and tier bytes + the pool limit.

        Page-locked allocators (CUDA hosts) keep their fixed limit: page-locking
        a CPU tier's whole budget in the background holds the CUDA driver, and
        that has not been measured against serving on a GPU.
        """
        if not self._page_locked:
            self._headroom = headroom

    def _limit(self) -> int:
        """Bytes the pool may hold now (call with the lock held)."""
        if self._headroom is None:
            return self._pool_limit
        try:
            return max(self._pool_limit, int(self._headroom()))
        except Exception:  # noqa: BLE001 - a tier's accounting must never break an allocation
            return self._pool_limit

    def new_object(self, key: ChunkKey, header: ChunkHeader) -> ChunkObject | None:
        """A fresh object for ``header`` (header bytes written, payload unspecified); None if memory is short."""
        buffer = self.allocate(header.total_bytes)
        if buffer is None:
            return None
        obj = ChunkObject(key, header, buffer, self)
        obj.write_header()
        return obj

    def allocate(self, num_bytes: int) -> torch.Tensor | None:
        class_bytes = size_class_bytes(num_bytes)
        with self._lock:
            if class_bytes == self._warm_class:
                self._warm_wanted.set()  # top the pool up again once the caller's burst is over
            free = self._pool.get(class_bytes)
            if free:
                self._pooled_bytes -= class_bytes
                return free.pop()
        return self._fresh(class_bytes)

    def keep_warm(self, num_bytes: int) -> None:
        """Keep the pool filled with touched buffers for objects of ``num_bytes`` (a background thread).

        Every chunk a save gathers or a load brings from disk or a remote store
        needs a buffer, and while the CPU tier is filling up none comes back to
        the pool: each would be fresh memory, faulted in on vLLM's critical
        path (measured here: 32 fresh 4 MiB buffers 32-170 ms, the same writes
        into touched memory 6 ms). A low-priority thread allocates and touches
        buffers ahead of demand, up to the pool limit.
        """
        if self._pool_limit <= 0 or num_bytes <= 0:
            return
        with self._lock:
            self._warm_class = size_class_bytes(num_bytes)
            if self._warmer is None:
                self._warmer = threading.Thread(target=self._warm_loop, name="lmi-host-warmer", daemon=True)
                self._warmer.start()
        self._warm_wanted.set()

    def _warm_loop(self) -> None:
        unpin_current_thread()
        _run_only_when_idle()
        while not self._closed:
            self._warm_wanted.wait()
            while not self._closed:
                # Wait for a quiet moment: refilling while a step takes buffers would compete with it.
                self._warm_wanted.clear()
                if self._warm_wanted.wait(WARM_QUIET_S):
                    continue
                with self._lock:
                    size = self._warm_class
                    if self._pooled_bytes + size > self._limit():
                        break
                buffer = self._fresh(size)
                if buffer is None:
                    break
                buffer.zero_()  # faults every page in now; torch releases the GIL meanwhile
                self.recycle(buffer)

    def close(self) -> None:
        self._closed = True
        self._warm_wanted.set()
        warmer = self._warmer
        if warmer is not None and warmer is not threading.current_thread():
            warmer.join(timeout=5.0)  # never leave it touching memory while the interpreter exits

    def recycle(self, buffer: torch.Tensor) -> None:
        size = int(buffer.numel())
        with self._lock:
            if not self._closed and self._pooled_bytes + size <= self._limit():
                self._pool[size].append(buffer)
                self._pooled_bytes += size

    def trim(self) -> None:
        self.close()
        with self._lock:
            self._pool.clear()
            self._pooled_bytes = 0

    def _fresh(self, class_bytes: int) -> torch.Tensor | None:
        raw: torch.Tensor | None = None
        if self._page_locked:
            try:
                raw = torch.empty(class_bytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as err:
                self._page_locked = False
                logger.warning("host memory: page-locked memory unavailable (%s); using pageable memory", err)
        try:
            if raw is None and class_bytes >= HUGE_PAGE_BYTES:
                return _huge_page_buffer(class_bytes)
            if raw is None:
                raw = torch.empty(class_bytes + PAGE_BYTES, dtype=torch.uint8)
            offset = (-raw.data_ptr()) % PAGE_BYTES
            return raw[offset : offset + class_bytes]
        except (RuntimeError, MemoryError, OSError) as err:
            logger.warning("host memory: cannot allocate %d bytes (%s)", class_bytes, err)
            return None


def _run_only_when_idle() -> None:
    """Put the calling thread below every serving thread: SCHED_IDLE where Linux offers it, else nice 10.

    Touching fresh pages is a core's worth of work for tens of milliseconds per
    buffer. At nice 10 the scheduler still hands it a slice of a core that
    vLLM's OpenMP threads are computing on, and a parallel region waits for
    its slowest thread (a precaution: the no-reuse benchmark cannot resolve
    the difference on this host). SCHED_IDLE runs the thread only on a core
    nothing else wants; when the host is busy the pool simply refills later,
    and an allocation that finds it empty faults its own pages as it would
    without a warmer.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread on Linux
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _huge_page_buffer(num_bytes: int) -> torch.Tensor:
    """A page-aligned anonymous mapping that asks for transparent huge pages.

    A new buffer is written once, right after allocation, on vLLM's critical
    path: with 4 KiB pages a 4 MiB chunk costs ~1,000 page faults (measured
    here: first write 1.9 ms vs 1.0 ms with MADV_HUGEPAGE). The tensor keeps
    the mapping alive.
    """
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only; elsewhere plain pages
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled: plain pages, still correct
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "non-writable buffer" does not apply to an anonymous mapping
        return torch.frombuffer(mapping, dtype=torch.uint8)

"""Tests for the CPU tier (references to host-memory chunk objects) and the host allocator."""
from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from lmi_cache.keys.chunk_format import HEADER_BYTES, ChunkHeader
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics, safety_net_firings
from lmi_cache.tiers.buffers import size_class_bytes
from lmi_cache.tiers.cpu_tier import CpuTier
from lmi_cache.tiers.host_memory import ChunkObject, HostAllocator

ALLOC = HostAllocator(page_locked=False)


def make_tier(capacity: int) -> CpuTier:
    return CpuTier(capacity, metrics=CacheMetrics(), warner=RateLimitedWarner(logging.getLogger()))


def key_of(number: int, fingerprint: int | None = None) -> ChunkKey:
    return ChunkKey(number.to_bytes(16, "little"), 0, 16, number if fingerprint is None else fingerprint)


def make_object(number: int, data: torch.Tensor, allocator: HostAllocator = ALLOC) -> ChunkObject:
    payload = data.reshape(-1).view(torch.uint8)
    header = ChunkHeader.for_key(key_of(number), int(payload.numel()), str(data.dtype).removeprefix("torch."),
                                 tuple(data.shape))
    obj = allocator.new_object(key_of(number), header)
    assert obj is not None
    obj.payload_tensor().copy_(data)
    return obj


def put_tensor(tier: CpuTier, number: int, data: torch.Tensor) -> bool:
    obj = make_object(number, data)
    try:
        return tier.put(obj)
    finally:
        obj.release()  # the tier holds its own reference


def get(tier: CpuTier, number: int, fingerprint: int | None = None) -> torch.Tensor | None:
    for batch in tier.get_many([key_of(number, fingerprint)]):
        for _, obj in batch:
            try:
                return obj.payload_tensor().clone()
            finally:
                obj.release()
    return None


def test_round_trip_keeps_dtype_shape() -> None:
    tier = make_tier(1 << 20)
    data = torch.randn(3, 5).to(torch.bfloat16)
    assert put_tensor(tier, 1, data)
    got = get(tier, 1)
    assert got is not None and got.dtype == torch.bfloat16 and torch.equal(got, data)
    assert get(tier, 2) is None


def test_put_is_by_reference_not_a_copy() -> None:
    tier = make_tier(1 << 20)
    obj = make_object(1, torch.ones(8))
    assert tier.put(obj) and obj.refs == 2
    hits = [o for batch in tier.get_many([key_of(1)]) for _, o in batch]
    assert hits == [obj] and obj.refs == 3
    for o in hits + [obj]:
        o.release()
    assert obj.refs == 1  # the tier's own
    assert tier.remove(key_of(1).digest) and obj.refs == 0


def test_a_full_tier_refuses_and_counts_instead_of_evicting() -> None:
    per = size_class_bytes(HEADER_BYTES + 32)
    tier = make_tier(3 * per)
    for number in range(3):
        assert put_tensor(tier, number, torch.ones(8))
    fired = safety_net_firings()
    assert not put_tensor(tier, 3, torch.ones(8))  # no room: the directory would have evicted first
    assert safety_net_firings() == fired + 1
    assert all(tier.contains(key_of(n).digest) for n in range(3)) and not tier.contains(key_of(3).digest)
    assert tier.used_bytes == 3 * per == tier.capacity_bytes
    assert tier.remove(key_of(1).digest) and put_tensor(tier, 3, torch.ones(8))  # room made by a removal
    assert safety_net_firings() == fired + 1


def test_a_removal_keeps_buffers_alive_for_their_readers() -> None:
    per = size_class_bytes(HEADER_BYTES + 32)
    tier = make_tier(per)
    assert put_tensor(tier, 1, torch.full((8,), 1.0))
    reading = tier.peek(key_of(1).digest)  # a reader's reference: the lease a peer read holds
    assert reading is not None
    assert tier.remove(key_of(1).digest) and put_tensor(tier, 2, torch.full((8,), 2.0))
    assert not tier.contains(key_of(1).digest)
    assert torch.equal(reading.payload_tensor(), torch.full((8,), 1.0))  # not recycled under the reader
    reading.release()


def test_too_large_refused() -> None:
    tier = make_tier(4096)
    assert not put_tensor(tier, 1, torch.ones(4096))
    assert tier.used_bytes == 0


def test_fingerprint_mismatch_is_a_counted_miss() -> None:
    tier = make_tier(1 << 20)
    put_tensor(tier, 1, torch.ones(4))
    assert get(tier, 1, fingerprint=12345) is None
    assert not tier.contains(key_of(1).digest)


def test_allocator_recycles_into_a_bounded_warm_pool() -> None:
    allocator = HostAllocator(page_locked=False, pool_limit_bytes=2 * 8192)
    buffers = [allocator.allocate(5000) for _ in range(3)]
    assert all(b is not None and b.numel() == size_class_bytes(5000) and b.data_ptr() % 4096 == 0 for b in buffers)
    for buffer in buffers:
        allocator.recycle(buffer)  # type: ignore[arg-type]
    assert allocator.pooled_bytes == 2 * 8192  # the third went back to the OS
    again = allocator.allocate(5000)
    assert again is not None and again.data_ptr() in {b.data_ptr() for b in buffers}  # type: ignore[union-attr]


def test_page_lock_failure_falls_back(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real_empty = torch.empty

    def fake_empty(*args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.pop("pin_memory", False):
            raise RuntimeError("cudaHostAlloc failed")
        return real_empty(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "empty", fake_empty)
    allocator = HostAllocator(page_locked=True, pool_limit_bytes=0)
    with caplog.at_level(logging.WARNING):
        assert allocator.allocate(100) is not None and allocator.allocate(100) is not None
    assert sum("page-locked memory unavailable" in r.message for r in caplog.records) == 1
    assert not allocator.page_locked


def test_concurrent_readers_and_writers_never_see_wrong_bytes() -> None:
    size = 20_000
    tier = make_tier(6 * size_class_bytes(size + HEADER_BYTES))  # small: constant eviction
    errors: list[str] = []

    def writer(offset: int) -> None:
        for i in range(300):
            number = offset + i % 20
            tier.remove(key_of(offset + (i + 17) % 20).digest)  # removals as a directory would send them
            put_tensor(tier, number, torch.full((size,), number % 256, dtype=torch.uint8))

    def reader() -> None:
        for i in range(600):
            number = i % 40
            got = get(tier, number)
            if got is not None and not bool((got == number % 256).all()):
                errors.append(f"wrong bytes for {number}")

    threads = [threading.Thread(target=writer, args=(o,)) for o in (0, 20)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert tier.used_bytes <= tier.capacity_bytes


@pytest.fixture()
def warmer_on_any_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warmer at normal priority: under SCHED_IDLE it waits for an idle core, which a busy test machine may not have.

    Its idle-only policy has its own test (``test_the_warmer_runs_only_on_idle_cores``).
    """
    monkeypatch.setattr("lmi_cache.tiers.host_memory._run_only_when_idle", lambda: None)


@pytest.mark.usefixtures("warmer_on_any_core")
def test_keep_warm_fills_the_pool_with_touched_buffers_in_the_background() -> None:
    import time

    allocator = HostAllocator(page_locked=False, pool_limit_bytes=4 * size_class_bytes(100_000))
    allocator.keep_warm(100_000)
    deadline = time.monotonic() + 10
    while allocator.pooled_bytes < 4 * size_class_bytes(100_000) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert allocator.pooled_bytes == 4 * size_class_bytes(100_000)  # up to the limit, not beyond
    taken = [allocator.allocate(100_000) for _ in range(2)]
    assert allocator.pooled_bytes == 2 * size_class_bytes(100_000)
    while allocator.pooled_bytes < 4 * size_class_bytes(100_000) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert allocator.pooled_bytes == 4 * size_class_bytes(100_000)  # topped up again after use
    assert all(t is not None for t in taken)
    allocator.trim()
    assert allocator.pooled_bytes == 0


def _wait_for_pool(allocator: HostAllocator, num_bytes: int) -> None:
    import time

    deadline = time.monotonic() + 30  # the warmer runs only on idle cores: give a busy machine time
    while allocator.pooled_bytes < num_bytes and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.usefixtures("warmer_on_any_core")
def test_headroom_lets_the_warmer_touch_the_tiers_unused_budget() -> None:
    """Until the CPU tier is full its buffers come touched, not faulted in on vLLM's critical path."""
    size = size_class_bytes(100_000)
    budget = [6 * size]
    allocator = HostAllocator(page_locked=False, pool_limit_bytes=size)
    allocator.set_headroom(lambda: budget[0])
    allocator.keep_warm(100_000)
    _wait_for_pool(allocator, 6 * size)
    assert allocator.pooled_bytes == 6 * size  # the budget, past the fixed limit, and no more
    taken = [allocator.allocate(100_000) for _ in range(4)]
    budget[0] = 2 * size  # the tier took four buffers and now has room for two more
    for buffer in taken:
        assert buffer is not None
        allocator.recycle(buffer)  # kept only while pool + tier stay within the budget
    assert allocator.pooled_bytes == 2 * size
    budget[0] = 0  # the tier is full: back to the fixed limit
    allocator.allocate(100_000)
    allocator.allocate(100_000)
    spare = allocator.allocate(100_000)
    assert spare is not None and allocator.pooled_bytes == 0
    allocator.recycle(spare)
    _wait_for_pool(allocator, size)
    assert allocator.pooled_bytes == size
    allocator.trim()


def test_a_failing_headroom_falls_back_to_the_fixed_limit() -> None:
    size = size_class_bytes(100_000)
    allocator = HostAllocator(page_locked=False, pool_limit_bytes=size)

    def broken() -> int:
        raise RuntimeError("tier gone")

    allocator.set_headroom(broken)
    buffers = [allocator.allocate(100_000) for _ in range(3)]
    for buffer in buffers:
        assert buffer is not None
        allocator.recycle(buffer)
    assert allocator.pooled_bytes == size
    allocator.trim()


def test_page_locked_pools_keep_their_fixed_limit() -> None:
    allocator = HostAllocator(page_locked=True, pool_limit_bytes=4096)
    allocator.set_headroom(lambda: 1 << 30)
    assert allocator._limit() == 4096
    allocator.trim()


@pytest.mark.usefixtures("warmer_on_any_core")
def test_an_engines_cpu_tier_budget_is_kept_warm() -> None:
    from lmi_cache.config.cache_config import CacheConfig
    from lmi_cache.engine import CacheEngine

    payload = 100_000
    with CacheEngine(CacheConfig(chunk_size=16, max_local_cpu_size=40 / 1024)) as engine:  # 40 MiB
        engine.expect_chunks(payload)
        size = size_class_bytes(HEADER_BYTES + payload)
        capacity = engine.tiers[0].capacity_bytes
        _wait_for_pool(engine.allocator, capacity - size)
        assert capacity - size < engine.allocator.pooled_bytes <= capacity
        assert capacity > 32 << 20  # more than the engine's fixed pool limit for this tier


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_warmer_runs_only_on_idle_cores() -> None:
    """Touching pages must never take a core from vLLM's OpenMP threads (it slowed every prefill)."""
    import threading
    import time

    allocator = HostAllocator(page_locked=False, pool_limit_bytes=size_class_bytes(100_000))
    allocator.keep_warm(100_000)
    deadline = time.monotonic() + 10
    while allocator.pooled_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    warmer = next(t for t in threading.enumerate() if t.name == "lmi-host-warmer")
    assert warmer.native_id is not None
    assert os.sched_getscheduler(warmer.native_id) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller keeps its own policy
    allocator.trim()

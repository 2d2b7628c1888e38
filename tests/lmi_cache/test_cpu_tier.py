"""Tests for lmi_cache.tiers.cpu_tier: byte budget, pinning, pool reuse, concurrency."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from lmi_cache.chunk_format import HEADER_BYTES, ChunkHeader
from lmi_cache.chunk_hashing import ChunkKey
from lmi_cache.eviction import make_policy
from lmi_cache.metrics import CacheMetrics, RateLimitedWarner
from lmi_cache.tiers.buffers import size_class_bytes
from lmi_cache.tiers.cpu_tier import CpuTier


def make_tier(capacity: int, **kwargs: object) -> CpuTier:
    return CpuTier(capacity, make_policy("LRU"), metrics=CacheMetrics(), warner=RateLimitedWarner(logging.getLogger()),
                   **kwargs)  # type: ignore[arg-type]


def key_of(number: int, fingerprint: int | None = None) -> ChunkKey:
    return ChunkKey(number.to_bytes(16, "little"), 0, 8, number if fingerprint is None else fingerprint)


def put_tensor(tier: CpuTier, number: int, data: torch.Tensor, pin: bool = False):  # type: ignore[no-untyped-def]
    payload = data.reshape(-1).view(torch.uint8)
    header = ChunkHeader.for_key(key_of(number), payload.numel(), str(data.dtype)[6:], tuple(data.shape))
    return tier.put(key_of(number), header, payload, pin=pin)


def test_round_trip_keeps_dtype_shape_and_is_a_copy() -> None:
    tier = make_tier(1 << 20)
    data = torch.randn(2, 3, 5, dtype=torch.float32).to(torch.bfloat16)
    assert put_tensor(tier, 1, data) is not None
    data.zero_()  # the caller may reuse its buffer
    got = tier.load(key_of(1))
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (2, 3, 5)
    assert not torch.equal(got, data)
    got.fill_(7)  # and the result is the caller's own
    again = tier.load(key_of(1))
    assert again is not None and not torch.equal(again, got)


def test_load_into_out() -> None:
    tier = make_tier(1 << 20)
    data = torch.arange(64, dtype=torch.int32).reshape(8, 8)
    put_tensor(tier, 1, data)
    out = torch.empty(64, dtype=torch.int32)
    assert tier.load(key_of(1), out=out) is out and torch.equal(out, data.reshape(-1))
    with pytest.raises(ValueError):
        tier.load(key_of(1), out=torch.empty(3, dtype=torch.int32))


def test_lru_eviction_and_budget() -> None:
    size = 8192 - HEADER_BYTES
    tier = make_tier(3 * size_class_bytes(size + HEADER_BYTES))
    for number in range(3):
        put_tensor(tier, number, torch.zeros(size, dtype=torch.uint8))
    assert tier.load(key_of(0)) is not None  # 0 is now most recent
    put_tensor(tier, 3, torch.zeros(size, dtype=torch.uint8))
    assert [tier.contains(key_of(n).digest) for n in range(4)] == [True, False, True, True]
    assert tier.used_bytes <= tier.capacity_bytes


def test_full_of_pinned_refuses_without_blocking() -> None:
    size = 8192 - HEADER_BYTES
    tier = make_tier(2 * size_class_bytes(size + HEADER_BYTES))
    entries = [put_tensor(tier, n, torch.zeros(size, dtype=torch.uint8), pin=True) for n in range(2)]
    assert put_tensor(tier, 9, torch.zeros(size, dtype=torch.uint8)) is None
    assert tier._metrics.snapshot()["cpu_dropped_full"] == 1
    for entry in entries:
        tier.unpin(entry)
    assert put_tensor(tier, 9, torch.zeros(size, dtype=torch.uint8)) is not None


def test_too_large_refused() -> None:
    tier = make_tier(4096)
    assert put_tensor(tier, 1, torch.zeros(10_000, dtype=torch.uint8)) is None
    assert tier._metrics.snapshot()["cpu_dropped_too_large"] == 1


def test_evicted_buffer_is_reused() -> None:
    size = 100_000
    tier = make_tier(size_class_bytes(size + HEADER_BYTES))
    first = put_tensor(tier, 1, torch.zeros(size, dtype=torch.uint8))
    second = put_tensor(tier, 2, torch.ones(size, dtype=torch.uint8))
    assert first is not None and second is not None
    assert first.buffer.data_ptr() == second.buffer.data_ptr()  # recycled, not reallocated
    got = tier.load(key_of(2))
    assert got is not None and bool((got == 1).all())


def test_fingerprint_mismatch_is_a_counted_miss() -> None:
    tier = make_tier(1 << 20)
    put_tensor(tier, 1, torch.zeros(4))
    assert tier.load(key_of(1, fingerprint=12345)) is None
    assert tier._metrics.snapshot()["cpu_fingerprint_mismatches"] == 1
    assert not tier.contains(key_of(1).digest)


def test_pin_memory_failure_falls_back(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real_empty = torch.empty

    def fake_empty(*args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.pop("pin_memory", False):
            raise RuntimeError("cudaHostAlloc failed")
        return real_empty(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "empty", fake_empty)
    tier = make_tier(1 << 20, pin_memory=True)
    with caplog.at_level(logging.WARNING):
        assert put_tensor(tier, 1, torch.ones(8)) is not None
        assert put_tensor(tier, 2, torch.ones(8)) is not None
    assert sum("pinned host memory unavailable" in r.message for r in caplog.records) == 1


def test_concurrent_readers_and_writers_never_see_wrong_bytes() -> None:
    size = 20_000
    tier = make_tier(6 * size_class_bytes(size + HEADER_BYTES))  # small: constant eviction
    errors: list[str] = []

    def writer(offset: int) -> None:
        for i in range(300):
            number = offset + i % 20
            put_tensor(tier, number, torch.full((size,), number % 256, dtype=torch.uint8))

    def reader() -> None:
        for i in range(600):
            number = i % 40
            got = tier.load(key_of(number))
            if got is not None and not bool((got == number % 256).all()):
                errors.append(f"wrong bytes for {number}")

    threads = [threading.Thread(target=writer, args=(o,)) for o in (0, 20)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert tier.used_bytes + tier.pooled_bytes <= tier.capacity_bytes

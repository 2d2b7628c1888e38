"""Tests for lmi_cache.eviction and the CPU tier's eviction invariants under random workloads."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.chunk_format import ChunkHeader
from lmi_cache.chunk_hashing import ChunkKey
from lmi_cache.eviction import make_policy
from lmi_cache.eviction.lru import FIFOPolicy, LRUPolicy
from lmi_cache.metrics import CacheMetrics, RateLimitedWarner
from lmi_cache.tiers.buffers import size_class_bytes
from lmi_cache.tiers.cpu_tier import CpuEntry, CpuTier


def test_lru_order() -> None:
    policy = LRUPolicy()
    for key in "abc":
        policy.on_insert(key)
    policy.on_access("a")
    assert list(policy.candidates()) == ["b", "c", "a"]
    policy.on_remove("c")
    policy.on_remove("zzz")
    assert list(policy.candidates()) == ["b", "a"] and len(policy) == 2


def test_fifo_ignores_access() -> None:
    policy = FIFOPolicy()
    for key in "abc":
        policy.on_insert(key)
    policy.on_access("a")
    assert list(policy.candidates()) == ["a", "b", "c"]


def test_registry() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy) and isinstance(make_policy("FIFO"), FIFOPolicy)
    with pytest.raises(KeyError, match="LRU"):
        make_policy("random")


def key_of(number: int) -> ChunkKey:
    return ChunkKey(number.to_bytes(16, "little"), 0, 1, number)


def put(tier: CpuTier, number: int, size: int, pin: bool = False) -> CpuEntry | None:
    payload = torch.full((size,), number % 251, dtype=torch.uint8)
    header = ChunkHeader.for_key(key_of(number), size, "uint8", (size,))
    return tier.put(key_of(number), header, payload, pin=pin)


ops = st.lists(
    st.tuples(st.sampled_from(["put", "put_pin", "load", "unpin", "remove"]), st.integers(0, 30),
              st.integers(1, 40_000)),
    max_size=120,
)


@settings(max_examples=80, deadline=None)
@given(ops=ops, policy=st.sampled_from(["LRU", "FIFO"]))
def test_random_workload_invariants(ops: list[tuple[str, int, int]], policy: str) -> None:
    capacity = 160_000
    evicted: list[bytes] = []
    tier = CpuTier(capacity, make_policy(policy), metrics=CacheMetrics(), warner=RateLimitedWarner(_logger()),
                   on_evict=lambda e: evicted.append(e.digest))
    pinned: list[CpuEntry] = []
    sizes: dict[int, int] = {}
    for op, number, size in ops:
        if op in ("put", "put_pin"):
            entry = put(tier, number, size, pin=op == "put_pin")
            if entry is not None:
                sizes.setdefault(number, entry.header.payload_bytes)
                if op == "put_pin":
                    pinned.append(entry)
        elif op == "load":
            got = tier.load(key_of(number))
            if got is not None:
                assert got.numel() == sizes[number] and bool((got == number % 251).all())
        elif op == "unpin" and pinned:
            tier.unpin(pinned.pop(number % len(pinned)))
        elif op == "remove":
            tier.remove(key_of(number).digest)
        assert tier.used_bytes + tier.pooled_bytes <= capacity
        live_pinned = {e.digest for e in pinned if not e.dead}
        assert not live_pinned & set(evicted), "a pinned entry was evicted"
        assert all(tier.contains(d) for d in live_pinned)
        expected_used = sum(size_class_bytes(e.header.total_bytes) for e in _entries(tier))
        expected_used += sum(e.class_bytes for e in {id(e): e for e in pinned}.values() if e.dead and e.pins)
        assert tier.used_bytes == expected_used
    for entry in pinned:
        tier.unpin(entry)
    tier.clear()
    assert tier.used_bytes == 0


def _entries(tier: CpuTier) -> list[CpuEntry]:
    return list(tier._index.values())  # white-box: the accounting must match the index exactly


def _logger():  # type: ignore[no-untyped-def]
    import logging

    return logging.getLogger("test")

"""Tests for lmi_cache.eviction and the CPU tier's eviction invariants under random workloads."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.keys.chunk_format import ChunkHeader
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.eviction import make_policy
from lmi_cache.eviction.lru import FIFOPolicy, LRUPolicy
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.tiers.cpu_tier import CpuTier
from lmi_cache.tiers.host_memory import ChunkObject, HostAllocator


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


ALLOC = HostAllocator(page_locked=False, pool_limit_bytes=0)


def new_object(number: int, size: int) -> ChunkObject:
    header = ChunkHeader.for_key(key_of(number), size, "uint8", (size,))
    obj = ALLOC.new_object(key_of(number), header)
    assert obj is not None
    obj.payload_array()[:] = number % 251
    return obj


ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "hold", "drop", "remove"]), st.integers(0, 30), st.integers(1, 40_000)),
    max_size=120,
)


@settings(max_examples=80, deadline=None)
@given(ops=ops)
def test_random_workload_invariants_of_the_cpu_store(ops: list[tuple[str, int, int]]) -> None:
    """The CPU tier as a store (the directory's evictions arrive as removals): its size never exceeded (a put
    past it is refused), accounting exact, bytes never wrong, every reference given back."""
    capacity = 160_000
    made: list[ChunkObject] = []
    held: list[ChunkObject] = []  # references a reader keeps across other operations
    tier = CpuTier(capacity, metrics=CacheMetrics(), warner=RateLimitedWarner(_logger()))
    for op, number, size in ops:
        if op == "put":
            obj = new_object(number, size)
            made.append(obj)
            tier.put(obj)
            obj.release()
        elif op in ("get", "hold"):
            for batch in tier.get_many([key_of(number)]):
                for _, obj in batch:
                    assert bool((torch.from_numpy(obj.payload_array()) == number % 251).all())
                    (held.append(obj) if op == "hold" else obj.release())
        elif op == "drop" and held:
            held.pop(number % len(held)).release()
        elif op == "remove":
            tier.remove(key_of(number).digest)
        assert tier.used_bytes <= capacity
        live = [tier.peek(d) for d in tier.digests()]
        assert tier.used_bytes == sum(o.class_bytes for o in live if o is not None)
        for o in live:
            if o is not None:
                o.release()
    for obj in held:
        obj.release()
    tier.clear()
    assert tier.used_bytes == 0 and all(obj.refs == 0 for obj in made)


def _logger():  # type: ignore[no-untyped-def]
    import logging

    return logging.getLogger("test")

"""Tests for lmi_cache.eviction.retaining: the retention book and the retention-aware eviction order."""
from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.eviction.lru import FIFOPolicy, LRUPolicy
from lmi_cache.eviction.retaining import RetainingPolicy, RetentionBook


class FakeTier:
    """What a tier does with a policy: sizes of present keys, inserts, reads, evictions."""

    def __init__(self, cap_bytes: int, inner: LRUPolicy | None = None) -> None:
        self.sizes: dict[Hashable, int] = {}
        self.policy = RetainingPolicy(inner if inner is not None else LRUPolicy(), cap_bytes, self.sizes.get)

    def put(self, key: Hashable, size: int = 10) -> None:
        self.sizes[key] = size
        self.policy.on_insert(key)

    def evict_one(self) -> Hashable:
        victim = next(iter(self.policy.candidates()))
        del self.sizes[victim]
        self.policy.on_remove(victim)
        return victim


def test_book_refcounts_shared_digests() -> None:
    book = RetentionBook()
    assert book.retain("a", ["sys", "a1"]) == ["sys", "a1"]
    assert book.retain("b", ["sys", "b1"]) == ["b1"]  # "sys" already retained by a
    assert book.retain("a", ["sys"]) == []  # idempotent per session
    assert book.release("a") == ["a1"]  # "sys" still held by b
    assert book.is_retained("sys") and not book.is_retained("a1")
    assert sorted(book.release("b")) == ["b1", "sys"]
    assert book.num_retained == 0 and book.sessions() == []
    assert book.release("never-opened") == []


def test_retained_chunks_are_evicted_after_all_others() -> None:
    tier = FakeTier(cap_bytes=1000)
    for key in ["s1", "s2", "x1", "x2"]:
        tier.put(key)
    tier.policy.retain("session", ["s1", "s2"])
    tier.put("x3")
    # s1 and s2 are the oldest, yet every unretained key goes first.
    assert [tier.evict_one() for _ in range(3)] == ["x1", "x2", "x3"]
    assert [tier.evict_one() for _ in range(2)] == ["s1", "s2"]  # never refuses a store: protected go last


def test_chunks_retained_before_they_are_stored_are_protected_on_insert() -> None:
    tier = FakeTier(cap_bytes=1000)
    tier.policy.retain("session", ["later"])
    tier.put("later")
    tier.put("other")
    assert tier.policy.is_protected("later")
    assert tier.evict_one() == "other"


def test_cap_bounds_protection_and_keeps_the_prompt_head() -> None:
    tier = FakeTier(cap_bytes=25)  # room for two 10-byte chunks
    for key in ["c0", "c1", "c2", "x"]:
        tier.put(key)
    tier.policy.retain("session", ["c0", "c1", "c2"])
    assert [tier.policy.is_protected(k) for k in ["c0", "c1", "c2"]] == [True, True, False]
    assert tier.policy.protected_bytes == 20
    # c2 is retained beyond the cap: an ordinary key, evicted in LRU order with the rest.
    assert [tier.evict_one() for _ in range(2)] == ["c2", "x"]


def test_first_come_keeps_protection_until_release() -> None:
    tier = FakeTier(cap_bytes=20)
    for key in ["a0", "a1", "b0", "b1"]:
        tier.put(key)
    tier.policy.retain("a", ["a0", "a1"])
    tier.policy.retain("b", ["b0", "b1"])  # no room: b does not take a's protection away
    assert tier.policy.is_protected("a0") and not tier.policy.is_protected("b0")
    tier.policy.release("a")
    assert not tier.policy.is_protected("a0") and tier.policy.protected_bytes == 0
    tier.policy.on_access("b0")  # a read of a retained chunk claims the room that appeared
    assert tier.policy.is_protected("b0")
    assert tier.policy.num_released_sessions == 1


def test_release_frees_everything_and_released_chunks_rejoin_the_order() -> None:
    tier = FakeTier(cap_bytes=1000)
    for key in ["s1", "x1"]:
        tier.put(key)
    tier.policy.retain("session", ["s1"])
    tier.policy.release("session")
    tier.policy.release("session")  # twice is harmless
    assert tier.policy.protected_bytes == 0 and tier.policy.book.num_retained == 0
    assert sorted(tier.policy.candidates()) == ["s1", "x1"] and len(tier.policy) == 2


def test_removed_protected_chunk_gives_back_its_bytes() -> None:
    tier = FakeTier(cap_bytes=10)
    tier.put("a")
    tier.policy.retain("s", ["a", "b"])
    tier.policy.on_remove("a")  # deleted (a damaged read, a clear)
    assert tier.policy.protected_bytes == 0
    tier.put("b")
    assert tier.policy.is_protected("b")


def test_wraps_fifo_too() -> None:
    tier = FakeTier(cap_bytes=100, inner=FIFOPolicy())
    for key in ["a", "b", "c"]:
        tier.put(key)
    tier.policy.retain("s", ["a"])
    assert list(tier.policy.candidates()) == ["b", "c", "a"]


def test_negative_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="cap_bytes"):
        RetainingPolicy(LRUPolicy(), -1, {}.get)


# Random workloads: puts, reads, evictions, retains and releases by a few sessions sharing chunks.
ops = st.lists(
    st.tuples(st.sampled_from(["put", "access", "evict", "retain", "release"]),
              st.integers(0, 3), st.lists(st.integers(0, 7), max_size=5), st.integers(1, 40)),
    max_size=150,
)


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(0, 60), operations=ops)
def test_invariants_under_random_workloads(cap: int, operations: list[tuple[str, int, list[int], int]]) -> None:
    tier = FakeTier(cap_bytes=cap)
    policy = tier.policy
    open_sessions: dict[str, set[int]] = {}
    for op, session_no, keys, size in operations:
        session = f"s{session_no}"
        if op == "put" and keys and keys[0] not in tier.sizes:
            tier.put(keys[0], size)
        elif op == "access" and keys and keys[0] in tier.sizes:
            policy.on_access(keys[0])
        elif op == "evict" and tier.sizes:
            victim = tier.evict_one()
            # Never a protected chunk while an unprotected one is there.
            assert not policy.is_protected(victim) or all(policy.is_protected(k) for k in tier.sizes)
        elif op == "retain":
            policy.retain(session, keys)
            open_sessions.setdefault(session, set()).update(keys)
        elif op == "release":
            policy.release(session)
            open_sessions.pop(session, None)
        protected = [k for k in tier.sizes if policy.is_protected(k)]
        # The cap is never exceeded by what is protected, and the byte count is exact.
        assert policy.protected_bytes == sum(tier.sizes[k] for k in protected) <= cap
        # Only chunks of open sessions are protected; a chunk shared by two sessions stays until both go.
        retained = set().union(*open_sessions.values()) if open_sessions else set()
        assert set(protected) <= retained
        assert all(policy.book.is_retained(k) == (k in retained) for k in range(8))
        # Every present key is a candidate exactly once.
        assert sorted(policy.candidates()) == sorted(tier.sizes) and len(policy) == len(tier.sizes)
    for session in list(open_sessions):
        policy.release(session)
    assert policy.protected_bytes == 0 and policy.book.num_retained == 0

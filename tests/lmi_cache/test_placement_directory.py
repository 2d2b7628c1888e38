"""The placement directory: budgets, eviction order, demotion, pins, completions, retention (no vLLM)."""
from __future__ import annotations

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.placement.book import TierSpec
from lmi_cache.placement.directory import REMOTE, LoadSource, PlacementDirectory
from lmi_cache.placement.messages import Eviction, TierEvent

CHUNK = 16
PAYLOAD = 1000  # bytes per chunk per rank


def exact(n: int) -> int:
    return n


def key(n: int, rank: int = 0) -> ChunkKey:
    return ChunkKey(bytes([n, rank]) * 8, 0, CHUNK, n)


def keys(n: int, ranks: int = 1) -> tuple[ChunkKey, ...]:
    return tuple(key(n, r) for r in range(ranks))


def directory(cpu_chunks: int = 3, disk_chunks: int = 0, ranks: int = 1, demote: bool = False,
              remote: object = None, retention: float = 0.0) -> PlacementDirectory:
    specs = [TierSpec("cpu", cpu_chunks * PAYLOAD, exact, retention_share=retention),
             TierSpec("disk", disk_chunks * PAYLOAD, exact)]
    d = PlacementDirectory(specs, chunk_tokens=CHUNK, write_through=() if demote else ("disk",),
                           demote_to="disk" if demote else None, remote=remote, remote_writes=remote is not None)
    for rank in range(ranks):
        d.sizes.set_chunk_bytes(rank, 0, PAYLOAD)
    return d


def evictions(d: PlacementDirectory) -> list[Eviction]:
    """The evictions decided since the last call, every rank's, checking each is addressed to its own rank."""
    by_rank = d.take_evictions()
    assert all(e.rank == rank for rank, es in by_rank.items() for e in es)
    return [e for es in by_rank.values() for e in es]


def sample(d: PlacementDirectory, name: str, tier: str) -> float | None:
    return d.metrics.registry.get_sample_value(name, {"engine": "0", "tier": tier})


def store(d: PlacementDirectory, n: int, ranks: int = 1) -> tuple[str, ...]:
    tiers = d.prepare_store(keys(n, ranks), 0)
    for rank in range(ranks):
        d.complete(rank, stored=[TierEvent(t, key(n, rank).digest, PAYLOAD) for t in tiers if t != REMOTE])
    d.end_step()
    return tiers


def test_a_store_is_pending_until_a_worker_confirms_it() -> None:
    d = directory()
    assert d.prepare_store(keys(1), 0) == ("cpu",)
    assert d.lookup(keys(1)) is None and d.books[0].knows(key(1).digest)  # pending
    assert d.prepare_store(keys(1), 0) == ()  # planned once, even for two requests in one step
    d.complete(0, stored=[TierEvent("cpu", key(1).digest, PAYLOAD)])
    assert d.lookup(keys(1)) == "cpu"


def test_a_failed_store_frees_its_room_and_is_a_miss() -> None:
    d = directory(cpu_chunks=1)
    d.prepare_store(keys(1), 0)
    d.complete(0, failed=[TierEvent("cpu", key(1).digest)])
    d.end_step()
    assert not d.books[0].knows(key(1).digest)
    assert store(d, 2) == ("cpu",) and evictions(d) == []  # the room came back


def test_the_least_recently_used_chunk_is_evicted_and_the_workers_told() -> None:
    d = directory(cpu_chunks=2)
    store(d, 1), store(d, 2)
    d.prepare_load(keys(1), 0, "cpu")  # 1 is used again: 2 is now the oldest
    d.end_step()
    store(d, 3)
    assert evictions(d) == [Eviction(0, "cpu", key(2).digest)]
    assert sample(d, "lmi_cache_placement_evictions_total", "cpu") == 1
    assert sample(d, "lmi_cache_placement_entries", "cpu") == 2
    assert d.lookup(keys(2)) is None and d.lookup(keys(1)) == "cpu"


def test_what_this_step_loads_is_never_evicted_by_its_stores() -> None:
    d = directory(cpu_chunks=1)
    store(d, 1)
    d.prepare_load(keys(1), 0, "cpu")
    assert d.prepare_store(keys(2), 0) == ()  # the only room is pinned by the load
    assert evictions(d) == []
    d.end_step()
    assert d.prepare_store(keys(2), 0) == ("cpu",)


def test_write_through_stores_go_to_disk_too_and_demotion_feeds_disk_from_evictions() -> None:
    d = directory(cpu_chunks=1, disk_chunks=4)
    assert store(d, 1) == ("cpu", "disk")
    e = directory(cpu_chunks=1, disk_chunks=4, demote=True)
    assert store(e, 1) == ("cpu",)
    store(e, 2)
    assert evictions(e) == [Eviction(0, "cpu", key(1).digest, "disk")]
    e.complete(0, stored=[TierEvent("disk", key(1).digest, PAYLOAD)])
    assert e.lookup(keys(1)) == "disk"


def test_a_disk_hit_is_promoted_when_the_first_tier_has_room() -> None:
    d = directory(cpu_chunks=1, disk_chunks=4)
    store(d, 1), store(d, 2)  # 1 left the CPU tier, stays on disk
    assert d.lookup(keys(1)) == "disk"
    assert d.prepare_load(keys(1), 0, "disk") == LoadSource("disk", promote=True)
    assert evictions(d) == [Eviction(0, "cpu", key(1).digest), Eviction(0, "cpu", key(2).digest)]
    d.complete(0, stored=[TierEvent("cpu", key(1).digest, PAYLOAD)])
    assert d.lookup(keys(1)) == "cpu"


def test_every_rank_must_hold_a_chunk_and_a_half_reservation_is_rolled_back() -> None:
    d = directory(cpu_chunks=2, ranks=2)
    d.sizes.set_chunk_bytes(1, 0, 3 * PAYLOAD)  # rank 1's chunks do not fit its budget
    assert d.prepare_store(keys(1, 2), 0) == ()
    assert not d.books[0].knows(key(1, 0).digest)  # rank 0's room was given back
    d.sizes.set_chunk_bytes(1, 0, PAYLOAD)
    d.end_step()
    tiers = d.prepare_store(keys(1, 2), 0)
    d.complete(0, stored=[TierEvent("cpu", key(1, 0).digest, PAYLOAD)])
    assert tiers == ("cpu",) and d.lookup(keys(1, 2)) is None  # rank 1 has not confirmed
    d.complete(1, stored=[TierEvent("cpu", key(1, 1).digest, PAYLOAD)])
    assert d.lookup(keys(1, 2)) == "cpu"


def test_an_entry_a_worker_lost_is_forgotten() -> None:
    d = directory(cpu_chunks=2, disk_chunks=2)
    store(d, 1)
    d.complete(0, dropped=[TierEvent("disk", key(1).digest)])
    assert d.lookup(keys(1)) == "cpu" and not d.books[1].knows(key(1).digest)
    assert sample(d, "lmi_cache_placement_dropped_total", "disk") == 1


def test_disk_files_found_at_start_are_hits_oldest_evicted_first() -> None:
    d = directory(cpu_chunks=1, disk_chunks=2)
    d.adopt("disk", 0, 0, key(7).digest, PAYLOAD)
    d.adopt("disk", 0, 0, key(8).digest, PAYLOAD)
    d.adopt("disk", 0, 0, key(9).digest, PAYLOAD)  # over the budget: the oldest goes
    assert d.lookup(keys(7)) is None and d.lookup(keys(8)) == d.lookup(keys(9)) == "disk"
    assert evictions(d) == [Eviction(0, "disk", key(7).digest)]  # the worker deletes it: the directory decides
    store(d, 1)
    assert Eviction(0, "disk", key(8).digest) in evictions(d)


def test_open_sessions_chunks_are_evicted_last() -> None:
    d = directory(cpu_chunks=3, retention=0.5)
    d.retain_for_session("s", [key(1).digest])  # before it is even stored
    for n in (1, 2, 3, 4):
        store(d, n)
    assert [e.digest for e in evictions(d)] == [key(2).digest]
    d.end_session("s")
    store(d, 5)
    assert [e.digest for e in evictions(d)] == [key(3).digest]


class _Remote:
    def has_many_async(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        return keys


def test_remote_writes_once_per_chunk_and_lookups_go_through_the_directory() -> None:
    d = directory(remote=_Remote())
    assert store(d, 1) == ("cpu", REMOTE)
    assert d.prepare_store(keys(1), 0) == ()
    assert d.ask_remote(keys(2)) == list(keys(2))


def test_a_store_it_never_planned_is_refused_counted_and_removed_again() -> None:
    d = directory(cpu_chunks=2, ranks=2)
    d.complete(1, stored=[TierEvent("cpu", key(5, 1).digest, PAYLOAD)])  # a worker's own store: no room was made
    assert not d.books[0].knows(key(5, 1).digest) and d.lookup(keys(5, 2)) is None
    assert sample(d, "lmi_cache_placement_unplanned_stores_total", "cpu") == 1
    assert d.take_evictions() == {1: [Eviction(1, "cpu", key(5, 1).digest)]}  # only the rank that stored it
    store(d, 1, ranks=2), store(d, 2, ranks=2)
    assert evictions(d) == [] and sample(d, "lmi_cache_placement_unplanned_stores_total", "cpu") == 1


def test_a_store_evicted_before_its_confirmation_is_counted_apart_not_as_unplanned() -> None:
    # Asynchronous scheduling: step 2 is planned before step 1's report, and evicts step 1's pending store.
    d = directory(cpu_chunks=1)
    assert d.prepare_store(keys(1), 0) == ("cpu",)
    d.end_step()  # step 1 planned; its worker has not reported yet
    assert d.prepare_store(keys(2), 0) == ("cpu",)  # step 2 needs the room: 1 (pending) is the victim
    assert evictions(d) == [Eviction(0, "cpu", key(1).digest)]
    d.complete(0, stored=[TierEvent("cpu", key(1).digest, PAYLOAD)])  # step 1's report crosses the eviction
    assert sample(d, "lmi_cache_placement_evicted_before_confirm_total", "cpu") == 1
    assert sample(d, "lmi_cache_placement_unplanned_stores_total", "cpu") is None  # no bug to signal
    assert not d.books[0].knows(key(1).digest) and evictions(d) == [Eviction(0, "cpu", key(1).digest)]
    d.complete(0, stored=[TierEvent("cpu", key(1).digest, PAYLOAD)])  # the same report again: now a stray
    assert sample(d, "lmi_cache_placement_unplanned_stores_total", "cpu") == 1
    assert sample(d, "lmi_cache_placement_evicted_before_confirm_total", "cpu") == 1


def test_a_store_never_planned_stays_unplanned_after_a_failed_one_was_evicted() -> None:
    d = directory(cpu_chunks=1)
    d.prepare_store(keys(1), 0)
    d.end_step()
    d.prepare_store(keys(2), 0)  # 1 evicted while pending
    d.complete(0, failed=[TierEvent("cpu", key(1).digest)])  # its store did not land: answered, forgotten
    d.complete(0, stored=[TierEvent("cpu", key(1).digest, PAYLOAD)])  # a later report of it is a stray
    assert sample(d, "lmi_cache_placement_unplanned_stores_total", "cpu") == 1
    assert sample(d, "lmi_cache_placement_evicted_before_confirm_total", "cpu") is None


def test_a_lease_keeps_a_held_chunk_across_steps_and_a_receive_is_planned_like_a_store() -> None:
    d = directory(cpu_chunks=2)
    store(d, 1)
    assert d.lease(keys(1), "cpu") and not d.lease(keys(9), "cpu")  # only what is held
    store(d, 2), store(d, 3)  # 2 is the victim: 1 is leased although it is older
    assert evictions(d) == [Eviction(0, "cpu", key(2).digest)]
    d.end_lease(keys(1), "cpu")
    assert d.prepare_receive(keys(4), 0, "cpu")  # a peer's read into a CPU slot: now 1 goes
    assert evictions(d) == [Eviction(0, "cpu", key(1).digest)]
    assert not d.prepare_receive(keys(4), 0, "cpu")  # already pending
    d.complete(0, stored=[TierEvent("cpu", key(4).digest, PAYLOAD)])
    assert d.lookup(keys(4)) == "cpu" and sample(d, "lmi_cache_placement_unplanned_stores_total", "cpu") is None

"""KV events from the placement directory's decisions: stores, evictions, demotions, failures, drops (no vLLM)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.placement import event_journal
from lmi_cache.placement.event_journal import EventJournal
from lmi_cache.placement.book import TierSpec
from lmi_cache.placement.directory import REMOTE, PlacementDirectory
from lmi_cache.placement.events import ChunkBlocks, RemovedBlocks, StoredBlocks, parents_first
from lmi_cache.placement.messages import TierEvent

CHUNK = 16
BLOCK = 4
PAYLOAD = 1000


def key(n: int, rank: int = 0) -> ChunkKey:
    return ChunkKey(bytes([n, rank]) * 8, 0, CHUNK, n)


def keys(n: int, ranks: int = 1) -> tuple[ChunkKey, ...]:
    return tuple(key(n, r) for r in range(ranks))


def blocks(n: int) -> ChunkBlocks:
    """Chunk ``n`` covers four vLLM blocks with hashes 100n..100n+3; its parent is chunk n-1's last block."""
    return ChunkBlocks(tuple(100 * n + b for b in range(CHUNK // BLOCK)), 100 * (n - 1) + 3 if n > 1 else None,
                       tuple(range(n * CHUNK, (n + 1) * CHUNK)), BLOCK, kv_cache_spec_kind="full_attention")


def directory(cpu_chunks: int = 2, disk_chunks: int = 0, ranks: int = 1, demote: bool = False,
              events: bool = True) -> PlacementDirectory:
    specs = [TierSpec("cpu", cpu_chunks * PAYLOAD, lambda b: b), TierSpec("disk", disk_chunks * PAYLOAD, lambda b: b)]
    d = PlacementDirectory(specs, chunk_tokens=CHUNK, write_through=() if demote else ("disk",),
                           demote_to="disk" if demote else None)
    for rank in range(ranks):
        d.sizes.set_chunk_bytes(rank, 0, PAYLOAD)
    if events:
        d.enable_events()
    return d


def plan(d: PlacementDirectory, n: int, ranks: int = 1) -> tuple[str, ...]:
    return d.prepare_store(keys(n, ranks), 0, describe=lambda: blocks(n))


def land(d: PlacementDirectory, n: int, tiers: tuple[str, ...], ranks: tuple[int, ...] = (0,)) -> None:
    for rank in ranks:
        d.complete(rank, stored=[TierEvent(t, key(n, rank).digest, PAYLOAD) for t in tiers if t != REMOTE])


def store(d: PlacementDirectory, n: int) -> None:
    land(d, n, plan(d, n))
    d.end_step()


def test_a_chunk_is_announced_once_its_store_is_confirmed_not_when_planned() -> None:
    d = directory()
    tiers = plan(d, 1)
    assert d.take_events() == []  # pending: a router must not be told yet
    land(d, 1, tiers)
    assert d.take_events() == [StoredBlocks("CPU", blocks(1))]


def test_stores_confirmed_child_first_in_one_step_are_announced_parent_first() -> None:
    d = directory(cpu_chunks=4)
    tiers = {n: plan(d, n) for n in (1, 2, 3)}
    for n in (3, 2, 1):  # a worker's threads finished the prompt's chunks last to first
        land(d, n, tiers[n])
    assert d.take_events() == [StoredBlocks("CPU", blocks(n)) for n in (1, 2, 3)]


def test_a_moved_store_takes_the_later_changes_of_its_chunk_along() -> None:
    gone = RemovedBlocks("CPU", blocks(2).block_hashes)
    other = RemovedBlocks("STORAGE", blocks(5).block_hashes)
    assert parents_first([StoredBlocks("CPU", blocks(2)), gone, StoredBlocks("CPU", blocks(1)), other]) == [
        StoredBlocks("CPU", blocks(1)), StoredBlocks("CPU", blocks(2)), gone, other]


def test_a_parent_stored_in_another_medium_or_earlier_changes_nothing() -> None:
    batch = [StoredBlocks("CPU", blocks(2)), StoredBlocks("STORAGE", blocks(1)), StoredBlocks("CPU", blocks(3))]
    assert parents_first(batch) == batch


@given(st.permutations([(medium, n) for medium in ("CPU", "STORAGE") for n in range(1, 7)]))
def test_any_batch_order_comes_out_parents_first_and_whole(order: list[tuple[str, int]]) -> None:
    out = parents_first([StoredBlocks(medium, blocks(n)) for medium, n in order])
    assert sorted((c.medium, c.blocks.block_hashes[0] // 100) for c in out) == sorted(order)
    position = {(c.medium, c.blocks.block_hashes[0] // 100): i for i, c in enumerate(out)}
    assert all(position[(medium, n - 1)] < position[(medium, n)] for medium, n in order if n > 1)


def test_write_through_announces_each_tier_under_its_medium() -> None:
    d = directory(disk_chunks=4)
    store(d, 1)
    assert d.take_events() == [StoredBlocks("CPU", blocks(1)), StoredBlocks("STORAGE", blocks(1))]


def test_every_rank_must_hold_the_chunk_and_the_first_rank_to_lose_it_removes_it() -> None:
    d = directory(ranks=2)
    tiers = d.prepare_store(keys(1, 2), 0, describe=lambda: blocks(1))
    land(d, 1, tiers, ranks=(0,))
    assert d.take_events() == []  # rank 1 has not stored it: the server cannot serve it
    land(d, 1, tiers, ranks=(1,))
    assert d.take_events() == [StoredBlocks("CPU", blocks(1))]
    d.complete(1, dropped=[TierEvent("cpu", key(1, 1).digest)])
    assert d.take_events() == [RemovedBlocks("CPU", blocks(1).block_hashes)]


def test_an_eviction_removes_the_victim_s_blocks() -> None:
    d = directory(cpu_chunks=2)
    store(d, 1)
    store(d, 2)
    d.take_events()
    store(d, 3)  # LRU: chunk 1 goes
    assert d.take_events() == [RemovedBlocks("CPU", blocks(1).block_hashes), StoredBlocks("CPU", blocks(3))]


def test_a_demotion_is_stored_on_disk_before_it_is_removed_from_cpu() -> None:
    d = directory(cpu_chunks=1, disk_chunks=4, demote=True)
    store(d, 1)
    d.take_events()
    tiers = plan(d, 2)  # chunk 1 is demoted to make room
    assert [e.demote_to for es in d.take_evictions().values() for e in es] == ["disk"]
    assert d.take_events() == []  # in transit: still announced in CPU
    d.complete(0, stored=[TierEvent("disk", key(1).digest, PAYLOAD)])  # the worker wrote it to disk
    land(d, 2, tiers)
    assert d.take_events() == [StoredBlocks("STORAGE", blocks(1)), RemovedBlocks("CPU", blocks(1).block_hashes),
                               StoredBlocks("CPU", blocks(2))]


def test_a_demotion_that_does_not_land_still_removes_the_cpu_blocks() -> None:
    d = directory(cpu_chunks=1, disk_chunks=4, demote=True)
    store(d, 1)
    d.take_events()
    plan(d, 2)
    d.complete(0, failed=[TierEvent("disk", key(1).digest)])
    assert d.take_events() == [RemovedBlocks("CPU", blocks(1).block_hashes)]


def test_a_failed_store_is_never_announced_and_its_description_goes() -> None:
    d = directory()
    plan(d, 1)
    d.complete(0, failed=[TierEvent("cpu", key(1).digest)])
    assert d.take_events() == []
    assert d.events is not None and len(d.events) == 0  # bounded: nothing is kept for a chunk no tier expects


def test_descriptions_are_dropped_with_the_last_entry() -> None:
    d = directory(cpu_chunks=2)
    for n in range(1, 9):
        store(d, n)
    assert d.events is not None and len(d.events) == 2  # the two chunks the CPU tier holds


def test_a_chunk_a_tier_already_holds_is_announced_when_first_described() -> None:
    d = directory(cpu_chunks=2, disk_chunks=4)
    d.adopt("disk", 0, 0, key(1).digest, PAYLOAD)  # a file found at start, nothing known of its blocks
    assert d.take_events() == []
    d.prepare_load(keys(1), 0, "disk", describe=lambda: blocks(1))  # a request for it says what it is
    assert d.take_events() == [StoredBlocks("STORAGE", blocks(1))]


def test_without_events_nothing_is_described_or_kept() -> None:
    d = directory(events=False)
    called = []
    d.prepare_store(keys(1), 0, describe=lambda: called.append(1) or blocks(1))
    assert called == [] and d.events is None and d.take_events() == []


def test_a_restarted_directory_announces_the_disk_files_it_adopts(tmp_path: Path) -> None:
    path = str(tmp_path / "events-dp0.jsonl")
    first = directory(disk_chunks=4, events=False)
    first.enable_events(EventJournal(path))
    store(first, 1)
    store(first, 2)
    first.take_events()
    # A fresh process: it adopts the files of chunk 1 only (chunk 2's is gone) and knows nothing else yet.
    second = directory(disk_chunks=4, events=False)
    second.adopt("disk", 0, 0, key(1).digest, PAYLOAD)
    second.enable_events(EventJournal(path))
    assert second.take_events() == [StoredBlocks("STORAGE", blocks(1))]  # its first events
    assert [digests for digests, _ in EventJournal(path).load()] == [(key(1).digest,)]  # rewritten: live lines only


def test_a_damaged_journal_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events-dp0.jsonl"
    journal = EventJournal(str(path))
    journal.append((key(1).digest,), blocks(1))
    with open(path, "a", encoding="utf-8") as file:
        file.write('{"digests": ["zz"]\n')  # torn
    assert journal.load() == [((key(1).digest,), blocks(1))]


def test_the_journal_is_rewritten_when_it_grows_past_what_it_describes(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_journal, "REWRITE_MIN_LINES", 4)
    path = str(tmp_path / "events-dp0.jsonl")
    d = directory(cpu_chunks=1, disk_chunks=2, events=False)
    d.enable_events(EventJournal(path))
    for n in range(1, 12):
        store(d, n)
    assert len(EventJournal(path).load()) <= 2 * event_journal.JOURNAL_SLACK + 1  # not one line per store ever
    assert {digests for digests, _ in EventJournal(path).load()} >= {(key(11).digest,)}

"""Session retention: the placement directory evicts open sessions' chunks last; the scheduler side feeds it."""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch

from lmi_cache.keys.chunk_format import ChunkHeader
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.eviction.session_tracker import SessionSource, SessionTracker
from lmi_cache.metrics.scheduler_series import SchedulerMetrics
from lmi_cache.placement.book import TierSpec
from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.placement.messages import TierEvent
from lmi_cache.placement.startup import build_directory
from lmi_cache.tiers.entry_sizes import cpu_entry_bytes
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata, LmiWorkerMeta
from lmi_cache.vllm_connector.scheduler_side import SchedulerGeometry, SchedulerSide

PAYLOAD_BYTES = 16 << 10


def key_of(number: int) -> ChunkKey:
    return ChunkKey(number.to_bytes(16, "little"), 0, 16, number)


def make_directory(num_chunks: int, share: float) -> tuple[PlacementDirectory, int]:
    """A CPU tier of ``num_chunks`` chunk objects, as the connector's scheduler builds it from the config."""
    entry = cpu_entry_bytes(PAYLOAD_BYTES)
    config = CacheConfig(max_local_cpu_size=num_chunks * entry / 2**30, session_retention_share=share)
    directory = build_directory(config, replica=0, world_size=1, retention=share > 0)
    directory.sizes.set_chunk_bytes(0, 0, PAYLOAD_BYTES * config.chunk_size // 16)  # 16-token keys
    return directory, entry


def put(directory: PlacementDirectory, number: int) -> None:
    """A chunk stored and confirmed; the directory's evictions of it are applied at once."""
    key = key_of(number)
    if directory.prepare_store([key], 0):
        directory.complete(0, stored=[TierEvent("cpu", key.digest, PAYLOAD_BYTES)])
    directory.take_evictions()
    directory.end_step()


def held(directory: PlacementDirectory, number: int) -> bool:
    return directory.holds([key_of(number)])


def retained_bytes(directory: PlacementDirectory) -> float | None:
    return directory.metrics.registry.get_sample_value("lmi_cache_session_retained_bytes",
                                                       {"engine": "0", "tier": "cpu"})


def test_open_sessions_chunks_are_evicted_last_until_release() -> None:
    directory, entry = make_directory(10, 0.5)
    for number in (1, 2, 3):
        put(directory, number)
    directory.retain_for_session("s", [key_of(1).digest, key_of(2).digest, key_of(50).digest])  # 50 is saved later
    put(directory, 50)
    for number in range(100, 130):  # three tiers' worth of other chunks
        put(directory, number)
    assert all(held(directory, n) for n in (1, 2, 50)) and not held(directory, 3)
    assert retained_bytes(directory) == 3 * entry
    directory.end_session("s")
    put(directory, 200)
    assert retained_bytes(directory) == 0
    for number in range(201, 230):
        put(directory, number)
    assert not any(held(directory, n) for n in (1, 2, 50))


def test_protection_stops_at_the_share() -> None:
    directory, _ = make_directory(10, 0.3)  # room for 3 protected chunks
    for number in range(6):
        put(directory, number)
    directory.retain_for_session("s", [key_of(n).digest for n in range(6)])
    for number in range(100, 130):
        put(directory, number)
    assert [held(directory, n) for n in range(6)] == [True] * 3 + [False] * 3


def test_share_zero_is_plain_eviction() -> None:
    directory, _ = make_directory(10, 0.0)
    put(directory, 1)
    directory.retain_for_session("s", [key_of(1).digest])  # a no-op without retention
    for number in range(100, 130):
        put(directory, number)
    assert not held(directory, 1) and not retained_bytes(directory)


# -- scheduler side: a session request's chunks go to every worker once; closed sessions are released


def test_scheduler_sends_new_session_chunks_once_and_releases_closed_sessions(tmp_path: Any) -> None:
    from tests.lmi_cache.test_scheduler_side import BLOCK, CHUNK, TAG, key_space, new_req, output

    (tmp_path / "s1").mkdir()  # what NEW_SESSION leaves in the session store
    metrics = SchedulerMetrics()
    directory = PlacementDirectory([TierSpec("cpu", 1 << 30, lambda n: n, retention_share=0.5)], chunk_tokens=CHUNK,
                                   metrics=metrics)
    side = SchedulerSide(SchedulerGeometry(BLOCK, CHUNK, 2), key_space(2), directory, metrics=metrics,
                         sessions=SessionTracker(SessionSource(str(tmp_path), 600)))
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG, 1: TAG}, chunk_bytes={0: {0: 100}, 1: {0: 100}}))
    tokens = list(range(1, 76))

    def schedule(req_id: str, session: str | None) -> LmiConnectorMetadata:
        req = SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, num_tokens=len(tokens), cache_salt=None,
                              lora_request=None, session_id=session)
        side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, 0)
        return side.build_connector_meta(output([new_req(req_id, list(range(5)), 0)], {req_id: len(tokens)}))

    first = schedule("a", "s1")
    want = [k.digest for keys in key_space(2)(TAG).for_request(tokens, None, None).per_chunk for k in keys]
    assert len(first.saves) == 2 and len(want) == 4  # two chunks, two ranks
    for rank in (0, 1):  # the workers confirm the stores: the session's chunks are now protected
        side.update_from_workers(LmiWorkerMeta(stored={rank: [TierEvent("cpu", t.keys[rank].digest, 100)
                                                              for t in first.saves]}))
    side.build_connector_meta(output())
    side.finish_step(LmiConnectorMetadata())
    assert directory.books[0].protected_bytes() == 4 * 100
    schedule("b", "s1"), schedule("c", None), schedule("d", "not-a-session")
    (tmp_path / "s1").rmdir()  # CLOSE
    side.build_connector_meta(output())
    assert directory.books[0].protected_bytes() == 0
    assert metrics.registry.get_sample_value("lmi_cache_session_releases_total", {"engine": "0"}) == 1


def test_scheduler_without_tracker_sends_nothing() -> None:
    from tests.lmi_cache.test_scheduler_side import output

    side = SchedulerSide(SchedulerGeometry(16, 32, 1), lambda tag: None, directory=PlacementDirectory(  # type: ignore[arg-type,return-value]
        [], chunk_tokens=32))
    meta = side.build_connector_meta(output())
    side.finish_step(meta)
    assert meta.is_empty

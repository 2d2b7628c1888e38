"""Session retention wired through the CPU tier, the engine and both halves of the connector."""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch

from lmi_cache.keys.chunk_format import ChunkHeader
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.engine import CacheEngine
from lmi_cache.eviction.session_tracker import SessionSource, SessionTracker
from lmi_cache.metrics.series import CacheMetrics, RateLimitedWarner, SchedulerMetrics
from lmi_cache.tiers import cpu_tier
from lmi_cache.tiers.buffers import size_class_bytes
from lmi_cache.tiers.factory import TierContext
from lmi_cache.tiers.host_memory import ChunkObject, HostAllocator
from lmi_cache.transfer.layouts import ExpectedGeometry
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata, LmiWorkerMeta
from lmi_cache.vllm_connector.scheduler_side import SchedulerGeometry, SchedulerSide
from lmi_cache.vllm_connector.worker_side import WorkerSide

PAYLOAD_BYTES = 16 << 10
ALLOC = HostAllocator(page_locked=False)


def key_of(number: int) -> ChunkKey:
    return ChunkKey(number.to_bytes(16, "little"), 0, 16, number)


def put(tier: cpu_tier.CpuTier, number: int) -> None:
    header = ChunkHeader.for_key(key_of(number), PAYLOAD_BYTES, "uint8", (PAYLOAD_BYTES,))
    obj = ALLOC.new_object(key_of(number), header)
    assert obj is not None
    try:
        assert tier.put(obj)
    finally:
        obj.release()


def make_tier(num_chunks: int, share: float) -> tuple[cpu_tier.CpuTier, CacheMetrics, int]:
    class_bytes = size_class_bytes(PAYLOAD_BYTES + 64)  # + header, rounded like the allocator does
    metrics = CacheMetrics()
    config = CacheConfig(max_local_cpu_size=num_chunks * class_bytes / 2**30, session_retention_share=share)
    context = TierContext("0", metrics, RateLimitedWarner(logging.getLogger()), ALLOC, lambda obj: None,
                          lambda digest: None)
    tier = cpu_tier.build(config, context)
    assert tier is not None
    return tier, metrics, class_bytes


def test_cpu_tier_keeps_a_sessions_chunks_under_pressure_until_release() -> None:
    tier, metrics, _ = make_tier(10, 0.5)
    for number in (1, 2, 3):
        put(tier, number)
    tier.retain("s", [key_of(1).digest, key_of(2).digest, key_of(50).digest])  # 50 is saved later
    put(tier, 50)
    for number in range(100, 130):  # three tiers' worth of other chunks
        put(tier, number)
    assert all(tier.contains(key_of(n).digest) for n in (1, 2, 50)) and not tier.contains(key_of(3).digest)
    object_bytes = tier.index.entry_bytes(key_of(1).digest)
    assert object_bytes and metrics.snapshot()["cpu_session_retained_bytes"] == 3 * object_bytes
    tier.release("s")
    assert metrics.snapshot()["cpu_session_retained_bytes"] == 0
    for number in range(200, 230):
        put(tier, number)
    assert not any(tier.contains(key_of(n).digest) for n in (1, 2, 50))


def test_protection_stops_at_the_share() -> None:
    tier, _, _ = make_tier(10, 0.3)  # room for 3 protected chunks
    for number in range(6):
        put(tier, number)
    tier.retain("s", [key_of(n).digest for n in range(6)])
    for number in range(100, 130):
        put(tier, number)
    assert [tier.contains(key_of(n).digest) for n in range(6)] == [True] * 3 + [False] * 3


def test_share_zero_is_plain_eviction() -> None:
    tier, metrics, _ = make_tier(10, 0.0)
    put(tier, 1)
    tier.retain("s", [key_of(1).digest])  # a no-op without retention
    for number in range(100, 130):
        put(tier, number)
    assert not tier.contains(key_of(1).digest) and "cpu_session_retained_bytes" not in metrics.snapshot()


def test_engine_forwards_retain_and_release_to_its_tiers() -> None:
    class_bytes = size_class_bytes(PAYLOAD_BYTES + 64)
    engine = CacheEngine(CacheConfig(max_local_cpu_size=8 * class_bytes / 2**30, session_retention_share=0.5),
                         page_locked=False)
    try:
        fill = lambda outs: [out.fill_(1) for out in outs]  # noqa: E731
        engine.retain("s", [key_of(1).digest])
        engine.save_many([key_of(1)], (PAYLOAD_BYTES,), torch.uint8, fill)
        engine.save_many([key_of(n) for n in range(100, 120)], (PAYLOAD_BYTES,), torch.uint8, fill)
        assert engine.tiers[0].contains(key_of(1).digest)
        engine.release("s")
        engine.save_many([key_of(n) for n in range(200, 220)], (PAYLOAD_BYTES,), torch.uint8, fill)
        assert not engine.tiers[0].contains(key_of(1).digest)
    finally:
        engine.close()


# -- scheduler side: a session request's chunks go to every worker once; closed sessions are released


def test_scheduler_sends_new_session_chunks_once_and_releases_closed_sessions(tmp_path: Any) -> None:
    from tests.lmi_cache.test_scheduler_side import BLOCK, CHUNK, TAG, key_space, new_req, output

    (tmp_path / "s1").mkdir()  # what NEW_SESSION leaves in the session store
    metrics = SchedulerMetrics()
    side = SchedulerSide(SchedulerGeometry(BLOCK, CHUNK, 2), key_space(2), metrics=metrics,
                         sessions=SessionTracker(SessionSource(str(tmp_path), 600)))
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG, 1: TAG}))
    tokens = list(range(1, 76))

    def schedule(req_id: str, session: str | None) -> LmiConnectorMetadata:
        req = SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, num_tokens=len(tokens), cache_salt=None,
                              lora_request=None, session_id=session)
        side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, 0)
        return side.build_connector_meta(output([new_req(req_id, list(range(5)), 0)], {req_id: len(tokens)}))

    first = schedule("a", "s1")
    want = [tuple(k.digest for k in keys) for keys in key_space(2)(TAG).for_request(tokens, None, None).per_chunk]
    assert first.retain == {"s1": want} and len(want[0]) == 2 and not first.is_empty
    assert schedule("b", "s1").retain == {}  # the same conversation again: nothing new to send
    assert schedule("c", None).retain == {} and schedule("d", "not-a-session").retain == {}
    (tmp_path / "s1").rmdir()  # CLOSE
    assert side.build_connector_meta(output()).release == ["s1"]
    assert metrics.registry.get_sample_value("lmi_cache_session_releases_total", {"engine": "0"}) == 1


def test_scheduler_without_tracker_sends_nothing() -> None:
    from tests.lmi_cache.test_scheduler_side import output

    side = SchedulerSide(SchedulerGeometry(16, 32, 1), lambda tag: None)  # type: ignore[arg-type,return-value]
    meta = side.build_connector_meta(output())
    assert meta.retain == {} and meta.release == [] and meta.is_empty


# -- worker side: each rank retains its own digests, release first, a fault never fails the step


class RetentionEngine:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail
        self.metrics = SimpleNamespace(error=lambda tier, op: self.calls.append(("error", (tier, op))))

    def retain(self, session: str, digests: list[bytes]) -> None:
        if self.fail:
            raise RuntimeError("boom")
        self.calls.append(("retain", (session, digests)))

    def release(self, session: str) -> None:
        self.calls.append(("release", session))


def worker(engine: RetentionEngine, rank: int) -> WorkerSide:
    side = WorkerSide(rank_index=rank, geometry=ExpectedGeometry(block_size_tokens=4, num_kv_heads=2, head_size=3),
                      chunk_size_tokens=8, engine_factory=lambda: engine)
    side.engine = engine
    return side


def test_worker_applies_release_then_its_ranks_retains() -> None:
    meta = LmiConnectorMetadata(release=["old"], retain={"s": [(b"r0-a", b"r1-a"), (b"r0-b", b"r1-b")]})
    engine = RetentionEngine()
    worker(engine, 1).save(meta)
    assert engine.calls == [("release", "old"), ("retain", ("s", [b"r1-a", b"r1-b"]))]


def test_worker_turns_a_retention_fault_into_a_counted_warning() -> None:
    engine = RetentionEngine(fail=True)
    worker(engine, 0).save(LmiConnectorMetadata(retain={"s": [(b"d",)]}))
    assert ("error", ("connector", "retain")) in engine.calls

"""The peer tier wired in: two engines read each other's CPU tiers, and the scheduler plans peer loads (no vLLM).

Engine A holds chunks; engine B loads them through its peer tier (``peer@H:P``
sources, as the scheduler plans them) and keeps them in its own CPU tier. The
scheduler side, given a request whose router names A, asks A which chunks it
holds and plans loads from it; a peer of another model is refused (a miss).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from engine_verbs import save  # noqa: E402
from local_ports import free_port_block  # noqa: E402
from placement_helpers import directory  # noqa: E402
from test_scheduler_remote import ask_until_answered  # noqa: E402
from test_scheduler_side import BLOCK, CHUNK, TAG, key_space, new_req, output, rank_keys  # noqa: E402

from lmi_cache.config.cache_config import config_from_dict  # noqa: E402
from lmi_cache.engine import CacheEngine  # noqa: E402
from lmi_cache.peer.hint import peer_hint, source_tier  # noqa: E402
from lmi_cache.peer.lookup import PeerLookups  # noqa: E402
from lmi_cache.peer.node import PeerNode, start_peer_node  # noqa: E402
from lmi_cache.peer.protocol import PeerIdentity  # noqa: E402
from lmi_cache.vllm_connector.metadata import LmiWorkerMeta  # noqa: E402
from lmi_cache.vllm_connector.scheduler_side import SchedulerGeometry, SchedulerSide  # noqa: E402


PROMPT = list(range(1, 107))  # 106 tokens: 3 full chunks of 32
IDENTITY = PeerIdentity.of(key_space(1)(TAG))


def peer_engine(identity: PeerIdentity = IDENTITY) -> tuple[CacheEngine, PeerNode, int]:
    port = free_port_block(2)
    config, _ = config_from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.05, "enable_p2p": True,
                                  "p2p_init_ports": [port], "p2p_lookup_ports": [port + 1]})
    engine = CacheEngine(config, page_locked=False)
    node = start_peer_node(config, identity, 0, 1, engine)
    assert node is not None
    return engine, node, port


@pytest.fixture
def holder() -> Iterator[tuple[CacheEngine, int]]:
    engine, node, port = peer_engine()
    for number, key in enumerate(rank_keys(PROMPT, 0, 1)[:2]):
        assert save(engine, key, torch.full((2, 8, 4), float(number + 1)))
    yield engine, port
    node.close()
    engine.close()


def loaded_tokens(engine: CacheEngine, tier: str) -> float:
    return engine.metrics.registry.get_sample_value(
        "lmi_cache_loaded_tokens_total", {"engine": "0", "rank": "0", "tier": tier}) or 0.0


def test_an_engine_loads_a_peers_chunks_into_its_cpu_tier(holder: tuple[CacheEngine, int]) -> None:
    _, port = holder
    reader, node, _ = peer_engine()
    try:
        keys = rank_keys(PROMPT, 0, 1)[:3]
        source = f"peer@127.0.0.1:{port}"
        got: dict[int, torch.Tensor] = {}
        for batch in reader.load(keys, [source] * 3, [True] * 3):
            for position, obj in batch:
                got[position] = obj.payload_tensor().clone()
                obj.release()
        assert sorted(got) == [0, 1]  # the third chunk the peer never held: a miss
        assert torch.equal(got[1], torch.full((2, 8, 4), 2.0))
        assert loaded_tokens(reader, "peer") == 2 * CHUNK
        cpu = reader.tiers[0]
        assert cpu.name == "cpu" and all(cpu.contains(k.digest) for k in keys[:2])  # promoted: one copy, kept
        stored, _ = reader.drain_events()
        assert {e.digest for e in stored if e.tier == "cpu"} == {k.digest for k in keys[:2]}
    finally:
        node.close()
        reader.close()


def hinted(req_id: str, port: int | None) -> Any:
    params = None if port is None else {"remote_kv_source": {"remote_host": "127.0.0.1", "remote_port": port}}
    return SimpleNamespace(request_id=req_id, prompt_token_ids=PROMPT, num_tokens=len(PROMPT), cache_salt=None,
                           lora_request=None, kv_transfer_params=params)


def scheduler(timeout_ms: int = 2000) -> SchedulerSide:
    side = SchedulerSide(SchedulerGeometry(BLOCK, CHUNK, 1), key_space(1), directory(CHUNK),
                         peer_lookups=PeerLookups(timeout_ms, 1))
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG}))
    return side


def peer_outcomes(side: SchedulerSide) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for family in side.metrics.registry.collect() for s in family.samples
            if s.name == "lmi_cache_peer_lookups_total"}


def test_the_scheduler_plans_loads_from_the_peer_a_request_names(holder: tuple[CacheEngine, int]) -> None:
    _, port = holder
    side = scheduler()
    req = hinted("r", port)
    assert peer_hint(req) is not None
    assert ask_until_answered(side, req) == (2 * CHUNK, False)
    assert peer_outcomes(side) == {"answered": 1.0}
    side.update_state_after_alloc(req, 2 * CHUNK)
    meta = side.build_connector_meta(output([new_req("r", list(range(10, 17)), 0)], {"r": len(PROMPT) - 2 * CHUNK}))
    assert [t.source for t in meta.loads] == [f"peer@127.0.0.1:{port}"] * 2
    assert {source_tier(t.source) for t in meta.loads} == {"peer"}
    assert all(t.promote_to == "cpu" for t in meta.loads)  # a CPU place reserved for what the peer sends
    assert side.metrics.registry.get_sample_value("lmi_cache_tier_hit_tokens_total",
                                                  {"engine": "0", "tier": "peer"}) == 2 * CHUNK
    assert ask_until_answered(side, hinted("plain", None)) == (0, False)  # no hint: no peer asked


def test_a_peer_of_another_model_is_refused() -> None:
    other, node, port = peer_engine(PeerIdentity.of(key_space(2)(TAG)))  # TP 2: another layout
    try:
        side = scheduler()
        assert ask_until_answered(side, hinted("r", port)) == (0, False)
        assert peer_outcomes(side) == {"refused": 1.0}
    finally:
        node.close()
        other.close()


def test_a_gone_peer_is_a_miss_within_the_timeout() -> None:
    side = scheduler(timeout_ms=300)
    started = time.monotonic()
    assert ask_until_answered(side, hinted("r", free_port_block(1))) == (0, False)
    assert time.monotonic() - started < 3.0
    assert peer_outcomes(side) == {"timeout": 1.0}

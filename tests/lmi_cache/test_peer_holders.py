"""Peers found without a router's hint: holder records in a real redis-server (no vLLM).

Server A's scheduler side advertises the chunks its workers confirm in the CPU
tier and withdraws the ones the directory evicts; server B's scheduler side,
given a request with no hint, asks the store who holds its chunks and plans
loads from that peer (a real peer node serving a CPU tier). A stale record,
a store that is down, and a server's own records are misses.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from engine_verbs import save  # noqa: E402
from placement_helpers import directory, stored  # noqa: E402
from remote_fixtures import redis_server, redis_settings  # noqa: E402,F401
from test_peer_wiring import PROMPT, hinted, holder, peer_outcomes  # noqa: E402,F401 (holder: a fixture)
from test_scheduler_remote import ask_until_answered  # noqa: E402
from test_scheduler_side import BLOCK, CHUNK, TAG, key_space, new_req, output, rank_keys  # noqa: E402

from lmi_cache.config.cache_config import config_from_dict  # noqa: E402
from lmi_cache.devtools.redis_server import RedisServer, free_port  # noqa: E402
from lmi_cache.engine import CacheEngine  # noqa: E402
from lmi_cache.peer.hint import PeerAddress  # noqa: E402
from lmi_cache.peer.holders import PeerHolders, open_peer_holders  # noqa: E402
from lmi_cache.peer.lookup import PeerLookups  # noqa: E402
from lmi_cache.remote.redis_store import RedisStore  # noqa: E402
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata, LmiWorkerMeta  # noqa: E402
from lmi_cache.vllm_connector.scheduler_side import SchedulerGeometry, SchedulerSide  # noqa: E402


def holders(url: str, prefix: str, port: int, advertise: bool = True) -> PeerHolders:
    settings = redis_settings(url, prefix, lookup_timeout_ms=500)
    return PeerHolders(RedisStore(settings), PeerAddress("127.0.0.1", port), advertise=advertise,
                       timeout_ms=settings.lookup_timeout_ms, backoff_initial_s=0.2, backoff_max_s=1.0)


def side_with(records: PeerHolders, cpu_bytes: int = 1 << 40, timeout_ms: int = 2000) -> SchedulerSide:
    side = SchedulerSide(SchedulerGeometry(BLOCK, CHUNK, 1), key_space(1), directory(CHUNK, cpu_bytes=cpu_bytes),
                         peer_lookups=PeerLookups(timeout_ms, 1, holders=records))
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG}))
    return side


def confirm(side: SchedulerSide, chunks: range) -> None:
    """The directory plans these chunks of PROMPT into the CPU tier, the worker confirms them, the step ends."""
    keys = rank_keys(PROMPT, 0, 1)
    for c in chunks:
        assert side.directory.prepare_receive([keys[c]], 0, "cpu")
    side.update_from_workers(stored({0: [keys[c].digest for c in chunks]}))
    side.finish_step(LmiConnectorMetadata())


def record(url: str, records: PeerHolders, chunk: int) -> dict[bytes, bytes]:
    return redis.Redis.from_url(url).hgetall(records.name_for(rank_keys(PROMPT, 0, 1)[chunk].digest))


def wait_for(check: Any, limit_s: float = 5.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def plain(req_id: str) -> Any:
    return hinted(req_id, None)


def test_confirmed_cpu_chunks_are_advertised_and_evicted_ones_withdrawn(redis_server: RedisServer) -> None:
    records = holders(redis_server.url, "adv", 8200)
    side = side_with(records, cpu_bytes=100)
    side.directory.sizes.set_chunk_bytes(0, 0, 60)  # the CPU tier fits one chunk
    confirm(side, range(1))
    assert wait_for(lambda: record(redis_server.url, records, 0))
    fields = record(redis_server.url, records, 0)
    assert list(fields) == [b"127.0.0.1:8200"] and int(fields[b"127.0.0.1:8200"]) > time.time()
    assert 0 < redis.Redis.from_url(redis_server.url).ttl(records.name_for(rank_keys(PROMPT, 0, 1)[0].digest))
    confirm(side, range(1, 2))  # evicts chunk 0 from the CPU tier
    assert wait_for(lambda: not record(redis_server.url, records, 0))
    assert list(record(redis_server.url, records, 1)) == [b"127.0.0.1:8200"]
    records.close()


def test_advertising_off_writes_nothing(redis_server: RedisServer) -> None:
    records = holders(redis_server.url, "quiet", 8200, advertise=False)
    side = side_with(records)
    confirm(side, range(2))
    time.sleep(0.3)  # a write, had one been queued, is sent within this
    assert not redis.Redis.from_url(redis_server.url).keys("quiet:*")
    records.close()


def test_a_request_without_hint_loads_from_the_holder_the_store_names(redis_server: RedisServer,
                                                                      holder: tuple[CacheEngine, int]) -> None:
    _, port = holder
    records_a = holders(redis_server.url, "find", port)
    confirm(side_with(records_a), range(2))  # A's scheduler advertises what its worker holds
    assert wait_for(lambda: record(redis_server.url, records_a, 1))
    records_b = holders(redis_server.url, "find", free_port())
    side_b = side_with(records_b)
    req = plain("r")
    assert ask_until_answered(side_b, req) == (2 * CHUNK, False)
    assert peer_outcomes(side_b) == {"answered": 1.0}
    side_b.update_state_after_alloc(req, 2 * CHUNK)
    meta = side_b.build_connector_meta(output([new_req("r", list(range(10, 17)), 0)], {"r": len(PROMPT) - 2 * CHUNK}))
    assert [t.source for t in meta.loads] == [f"peer@127.0.0.1:{port}"] * 2
    records_a.close()
    records_b.close()


def test_a_hint_wins_over_the_store(redis_server: RedisServer, holder: tuple[CacheEngine, int]) -> None:
    _, port = holder
    records_a = holders(redis_server.url, "hint", port)
    confirm(side_with(records_a), range(2))
    assert wait_for(lambda: record(redis_server.url, records_a, 1))
    records_b = holders(redis_server.url, "hint", free_port())
    side_b = side_with(records_b, timeout_ms=300)
    # The router names a server that is gone: B asks it (a timeout), not the holder the store names.
    assert ask_until_answered(side_b, hinted("r", free_port())) == (0, False)
    assert peer_outcomes(side_b) == {"timeout": 1.0}
    records_a.close()
    records_b.close()


def test_a_stale_record_is_a_miss(redis_server: RedisServer, holder: tuple[CacheEngine, int]) -> None:
    _, port = holder
    records_a = holders(redis_server.url, "stale", port)
    keys = rank_keys(PROMPT, 0, 1)
    records_a.held([keys[2].digest])  # A never held chunk 2 (or evicted it and the withdrawal was lost)
    records_a.flush()
    assert wait_for(lambda: record(redis_server.url, records_a, 2))
    records_b = holders(redis_server.url, "stale", free_port())
    side_b = side_with(records_b)
    # Chunks 0 and 1 are B's own, so B asks about chunk 2 only.
    confirm(side_b, range(2))
    assert ask_until_answered(side_b, plain("r")) == (2 * CHUNK, False)
    assert peer_outcomes(side_b) == {"answered": 1.0}  # A was asked and does not hold it
    assert side_b.metrics.value("lmi_cache_scheduler_peer_hit_chunks_total") == 0
    records_a.close()
    records_b.close()


def test_a_server_never_reads_its_own_records(redis_server: RedisServer) -> None:
    records = holders(redis_server.url, "own", 8200)
    side = side_with(records)
    records.held([k.digest for k in rank_keys(PROMPT, 0, 1)])
    records.flush()
    assert wait_for(lambda: record(redis_server.url, records, 2))
    assert ask_until_answered(side, plain("r")) == (0, False)
    assert peer_outcomes(side) == {"no_holder": 1.0}
    records.close()


def test_a_store_that_is_down_is_a_bounded_miss() -> None:
    records = holders(f"redis://127.0.0.1:{free_port()}", "down", 8200)
    side = side_with(records)
    assert ask_until_answered(side, plain("r")) == (0, False)
    assert peer_outcomes(side) == {"store_down": 1.0}
    confirm(side, range(1))  # advertising into a store that is down is dropped, never raised
    records.close()


def test_holder_records_need_the_peer_tier_and_a_redis_store() -> None:
    def config(**extra: Any) -> Any:
        return config_from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.05, **extra})[0]

    assert open_peer_holders(config(remote_url="redis://127.0.0.1:6379")) is None  # no peer tier
    assert open_peer_holders(config(enable_p2p=True)) is None  # no shared store
    assert open_peer_holders(config(enable_p2p=True, remote_url="s3://bucket/kv")) is None
    records = open_peer_holders(config(enable_p2p=True, remote_url="redis://127.0.0.1:6379", p2p_host="10.0.0.5",
                                       p2p_init_ports=[9000], p2p_lookup_ports=[9001],
                                       extra_config={"peer_advertise": False}))
    assert records is not None and records.own == PeerAddress("10.0.0.5", 9000) and not records.advertise
    records.close()


def test_peer_advertise_is_a_typed_switch() -> None:
    from lmi_cache.errors import ConfigError

    with pytest.raises(ConfigError, match="peer_advertise"):
        config_from_dict({"enable_p2p": True, "extra_config": {"peer_advertise": "sometimes"}})



class _AskedHolders:
    """Holder records that say who was asked about what (no store)."""

    timeout_ms = 200

    def __init__(self, answer: list[dict[PeerAddress, int]] | None = None) -> None:
        self.asked: list[bytes] = []
        self._answer = answer

    def holders_of(self, digests: list[bytes]) -> list[dict[PeerAddress, int]]:
        self.asked = list(digests)
        return self._answer if self._answer is not None else [{} for _ in digests]

    def held(self, digests: list[bytes]) -> None:
        pass

    gone = held

    def note_evictions(self, evictions: object) -> None:
        pass

    def note_reports(self, stored: object, lost: object, still_held: object) -> None:
        pass

    def flush(self) -> None:
        pass

    close = flush


def test_with_tensor_parallelism_the_store_is_asked_about_rank_0s_entries_only() -> None:
    records = _AskedHolders()
    side = SchedulerSide(SchedulerGeometry(BLOCK, CHUNK, 2), key_space(2), directory(CHUNK),
                         peer_lookups=PeerLookups(2000, 2, holders=records))  # type: ignore[arg-type]
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG, 1: TAG}))
    assert ask_until_answered(side, plain("r")) == (0, False)
    assert records.asked == [k.digest for k in rank_keys(PROMPT, 0, 2)[:3]]  # what rank 0 advertises
    assert peer_outcomes(side) == {"no_holder": 1.0}


def test_the_holder_of_the_longest_leading_run_is_chosen() -> None:
    from lmi_cache.peer.holders import choose_holder

    a, b, c = (PeerAddress("10.0.0.1", 8200), PeerAddress("10.0.0.2", 8200), PeerAddress("10.0.0.3", 8200))
    found = [{a: 5, b: 1}, {b: 1}, {a: 5, b: 1, c: 9}]
    assert choose_holder(found, ()) == b  # chunks 0-2 against a's chunk 0 only
    assert choose_holder(found, {b}) == a  # b did not answer lately
    assert choose_holder([{a: 5, c: 9}], ()) == c  # a tie: the latest advertised
    assert choose_holder([{}, {a: 5}], ()) is None  # a run starts at the first chunk

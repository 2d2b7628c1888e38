"""A Redis/Valkey for the peer tier's holder records only (``extra_config.peer_holders_url``), in a real redis-server.

Servers find each other's chunks through it without a remote tier: the store
ends up holding ``<prefix>:peer:v1:<digest>`` records and nothing else, while
the same chunks saved with the store as ``remote_url`` put KV values in it
(the check below would see them). The records' client reads the remote tier's
settings (key prefix, lookup timeout), and a ``peer_holders_url`` wins over a
Redis/Valkey ``remote_url`` for the records.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import redis
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from engine_verbs import save  # noqa: E402
from remote_fixtures import redis_server  # noqa: E402,F401
from test_peer_holders import confirm, side_with, wait_for  # noqa: E402
from test_peer_wiring import PROMPT  # noqa: E402
from test_scheduler_side import CHUNK, rank_keys  # noqa: E402

from lmi_cache.config.cache_config import config_from_dict  # noqa: E402
from lmi_cache.devtools.redis_server import RedisServer  # noqa: E402
from lmi_cache.engine import CacheEngine  # noqa: E402
from lmi_cache.peer.hint import PeerAddress  # noqa: E402
from lmi_cache.peer.holders import open_peer_holders  # noqa: E402


def server_config(prefix: str, **settings: Any) -> Any:
    """One server's LMCache config: the peer tier on, its extra_config keys plus ``settings``' own."""
    extra = {"remote_key_prefix": prefix, **settings.pop("extra_config", {})}
    return config_from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.05, "enable_p2p": True,
                             "p2p_init_ports": [9300], "p2p_lookup_ports": [9301], "extra_config": extra,
                             **settings})[0]


def serve_prompt(config: Any) -> Any:
    """What one server does with PROMPT: its worker saves the chunks to every tier the config builds (then waits
    for background writes), its scheduler advertises them. Returns the holder records (still open)."""
    engine = CacheEngine(config, page_locked=False)
    try:
        for number, key in enumerate(rank_keys(PROMPT, 0, 1)):
            assert save(engine, key, torch.full((2, 8, 4), float(number + 1)))
        engine.flush()
        tiers = [tier.name for tier in engine.tiers]
    finally:
        engine.close()
    records = open_peer_holders(config)
    assert records is not None
    confirm(side_with(records), range(3))
    return tiers, records


def stored_keys(url: str, prefix: str) -> list[bytes]:
    return sorted(redis.Redis.from_url(url).keys(f"{prefix}:*"))


def test_a_holders_only_store_gets_holder_records_and_no_kv(redis_server: RedisServer) -> None:
    config = server_config("solo", extra_config={"peer_holders_url": redis_server.url})
    assert config.remote_url is None
    tiers, records = serve_prompt(config)
    try:
        assert tiers == ["cpu"]  # no remote tier: nothing writes KV to the store
        names = sorted(records.name_for(k.digest).encode() for k in rank_keys(PROMPT, 0, 1))
        assert wait_for(lambda: len(stored_keys(redis_server.url, "solo")) >= 3)
        assert stored_keys(redis_server.url, "solo") == names  # the records, and only them
        assert all(b":peer:v1:" in name for name in names)
    finally:
        records.close()


def test_the_same_store_as_remote_url_also_holds_kv(redis_server: RedisServer) -> None:
    """The control: the key check above sees KV when the store is the remote tier's too."""
    tiers, records = serve_prompt(server_config("shared", remote_url=redis_server.url))
    try:
        assert "cpu" in tiers and len(tiers) == 2
        assert wait_for(lambda: sum(b":peer:" in k for k in stored_keys(redis_server.url, "shared")) >= 3)
        kv = [k for k in stored_keys(redis_server.url, "shared") if b":peer:" not in k]
        assert len(kv) >= 3, stored_keys(redis_server.url, "shared")
    finally:
        records.close()


def test_the_holder_store_reads_the_remote_settings_and_wins_over_remote_url(redis_server: RedisServer) -> None:
    config = server_config("mine", remote_url="redis://cache.invalid:6379", lookup_timeout_ms=120,
                           p2p_host="10.0.0.7", extra_config={"peer_holders_url": redis_server.url})
    records = open_peer_holders(config)
    assert records is not None
    try:
        assert records.own == PeerAddress("10.0.0.7", 9300) and records.timeout_ms == 120
        assert records.name_for(b"\x01").startswith("mine:peer:v1:")
        records.held([rank_keys(PROMPT, 0, 1)[0].digest])
        records.flush()
        assert wait_for(lambda: stored_keys(redis_server.url, "mine"))  # written here, not to cache.invalid
    finally:
        records.close()
    s3_remote = server_config("s3", remote_url="s3://bucket/kv", extra_config={"peer_holders_url": redis_server.url})
    records = open_peer_holders(s3_remote)  # an S3 remote tier keeps no records; the holder store does
    assert records is not None
    records.close()

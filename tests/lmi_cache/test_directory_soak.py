"""Soak: many stores, loads, evictions and demotions through the placement directory with real CPU and disk tiers.

The directory is the only index: after every step the CPU tier holds exactly
what the directory says it holds, the disk tier too once its writes are done,
every load returns the bytes stored, and no tier's safety net ever fires
(``lmi_cache_tier_safety_net_total``: a tier refusing a planned put would mean
the directory's sizes and the tier's disagree).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace
from lmi_cache.metrics.worker_series import safety_net_firings
from directed_engine import Directed  # noqa: E402
from engine_verbs import keys_for  # noqa: E402

NS = KeyNamespace("soak", "float32", "soak-v1")
CHUNK_SHAPE = (2, 16, 8)  # 1 KiB of float32: a 4 KiB CPU size class, one 4 KiB disk file
PAYLOAD_BYTES = 1024
NUM_CHUNKS = 60


def data_for(key: ChunkKey) -> torch.Tensor:
    return torch.arange(256, dtype=torch.float32).reshape(CHUNK_SHAPE) + key.start


@pytest.mark.parametrize("feed", ["write_through", "demote"])
def test_the_tiers_hold_exactly_what_the_directory_decided(tmp_path: Path, feed: str) -> None:
    config = CacheConfig(chunk_size=16, max_local_cpu_size=6 * 4096 / 1024**3, local_disk=(str(tmp_path),),
                         max_local_disk_size=20 * 4096 / 1024**3, disk_feed=feed, use_odirect=True)
    rng = random.Random(feed)
    fired = safety_net_firings()
    with Directed(config, PAYLOAD_BYTES) as d:
        keys = keys_for(d.engine, list(range(16 * NUM_CHUNKS)), NS)
        loaded = stored = 0
        for step in range(400):
            key = keys[min(int(rng.expovariate(1 / 12)), NUM_CHUNKS - 1)]  # a skewed working set
            if d.directory.lookup([key]) is None:
                stored += bool(d.save(key, data_for(key)))
            else:
                got = d.load(key)
                assert got is not None and torch.equal(got, data_for(key)), f"step {step}: wrong bytes"
                loaded += 1
            assert d.held("cpu") == d.planned("cpu"), f"step {step}: the CPU tier and the directory disagree"
            if step % 50 == 0:
                d.engine.flush()
                assert d.held("disk") == d.planned("disk"), f"step {step}: the disk tier and the directory disagree"
        d.step()
        d.engine.flush()
        assert d.held("disk") == d.planned("disk") and d.held("cpu") == d.planned("cpu")
        stats = d.engine.stats()
        assert stats["cpu_used_bytes"] <= stats["cpu_capacity_bytes"]
        assert stats["disk_used_bytes"] <= stats["disk_capacity_bytes"]
        assert stats["cpu_evictions"] > 0 and stats["disk_evictions"] > 0  # both budgets were under pressure
        assert loaded > 100 and stored > 50
        assert d.engine.drain_events()[1] == []  # no tier lost anything on its own
    assert safety_net_firings() == fired

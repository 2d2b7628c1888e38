"""RemoteCache over a real 3-node Redis cluster (own redis-server processes): keys spread, batches, a node lost."""
from __future__ import annotations

import shutil
import subprocess
import time
from typing import Iterator

import pytest
import redis
from remote_fixtures import make_keys, make_object, payload_of, redis_settings

from lmi_cache.remote import open_remote
from lmi_cache.devtools.redis_server import RedisServer
from lmi_cache.remote.value_codec import DecodedChunk, MissReason


@pytest.fixture
def cluster() -> Iterator[list[RedisServer]]:
    cli = shutil.which("redis-cli")
    assert cli is not None, "redis-cli comes with redis-server (apt-get install -y redis-server)"
    servers = [RedisServer(extra_args=["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
               for _ in range(3)]
    try:
        for server in servers:
            server.start()
        nodes = [f"127.0.0.1:{s.port}" for s in servers]
        subprocess.run([cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        clients = [redis.Redis(port=s.port) for s in servers]
        deadline = time.monotonic() + 30
        while any(c.cluster("info")["cluster_state"] != "ok" for c in clients):  # every node must agree
            assert time.monotonic() < deadline, "the test cluster did not come up"
            time.sleep(0.05)
        yield servers
    finally:
        for server in servers:
            server.stop()


def test_cluster_round_trip_spreads_keys_and_survives_a_lost_node(cluster: list[RedisServer]) -> None:
    # generous timeouts: this test is about correctness on a cluster, and the host may be busy
    cache = open_remote(redis_settings(f"redis://127.0.0.1:{cluster[0].port}?cluster=true", "cl",
                                       compression="zstd", lookup_timeout_ms=3000, io_timeout_ms=5000))
    try:
        keys = make_keys(24)
        objs = [make_object(k, 2048, seed=i) for i, k in enumerate(keys)]
        for key, obj in zip(keys, objs):
            assert cache.write(key, obj)
        assert cache.flush(10)
        assert cache.has_many(keys) == [True] * 24
        results = cache.read_many(keys)
        assert [bytes(r.payload) for r in results if isinstance(r, DecodedChunk)] == [payload_of(o) for o in objs]
        per_node = [redis.Redis(port=s.port).dbsize() for s in cluster]
        assert sum(per_node) == 24 and all(n > 0 for n in per_node)  # slots spread the digests
        cluster[2].kill()
        started = time.monotonic()
        assert cache.has_many(keys) == [False] * 24
        assert all(isinstance(r, MissReason) for r in cache.read_many(keys))
        assert time.monotonic() - started < 9.0  # bounded by the timeouts (a refused connection is faster)
        assert cache.stats()["down"] == 1
    finally:
        cache.close()

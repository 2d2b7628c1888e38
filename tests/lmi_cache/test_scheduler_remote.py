"""The scheduler asks the remote store for chunks beyond its local index: async, every rank, bounded.

Driven with the fake vLLM objects of test_scheduler_side and a real
redis-server: what a worker of another server stored there is planned as a
load; while the batched check is in flight the answer is ``(None, False)``;
a store that is down or a chunk missing on one rank is no hit.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from remote_fixtures import redis_server, redis_settings  # noqa: E402,F401
from placement_helpers import directory, stored  # noqa: E402
from test_scheduler_side import BLOCK, CHUNK, TAG, key_space, new_req, output, rank_keys, request  # noqa: E402

from lmi_cache.remote import open_remote  # noqa: E402
from lmi_cache.remote.cache import RemoteCache  # noqa: E402
from lmi_cache.devtools.redis_server import RedisServer, free_port  # noqa: E402
from lmi_cache.vllm_connector.metadata import LmiWorkerMeta  # noqa: E402
from lmi_cache.vllm_connector.scheduler_side import SchedulerGeometry, SchedulerSide  # noqa: E402

PROMPT = list(range(1, 107))  # 106 tokens: 3 full chunks of 32


def side_with(remote: RemoteCache, world_size: int = 2) -> SchedulerSide:
    side = SchedulerSide(SchedulerGeometry(BLOCK, CHUNK, world_size), key_space(world_size), directory(CHUNK, remote=remote))
    side.update_from_workers(LmiWorkerMeta(layout_tags={r: TAG for r in range(world_size)}))
    return side


def put_chunks(cache: RemoteCache, chunks: int, ranks: range) -> None:
    from remote_fixtures import make_object

    for rank in ranks:
        for key in rank_keys(PROMPT, rank, world_size=2)[:chunks]:
            assert cache.write(key, make_object(key))
    assert cache.flush(10.0)


def ask_until_answered(side: SchedulerSide, req: Any, limit_s: float = 5.0) -> tuple[int | None, bool]:
    deadline = time.monotonic() + limit_s
    while True:
        answer = side.get_num_new_matched_tokens(req, 0)
        if answer[0] is not None or time.monotonic() > deadline:
            return answer
        time.sleep(0.005)  # one scheduler step


def outcomes(side: Any) -> dict[str, float]:
    """lmi_cache_remote_lookups_total by outcome, as Prometheus would scrape it."""
    found: dict[str, float] = {}
    for family in side.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "lmi_cache_remote_lookups_total":
                found[sample.labels["outcome"]] = sample.value
    return found


def test_remote_chunks_of_every_rank_are_planned_as_loads(redis_server: RedisServer) -> None:
    cache = open_remote(redis_settings(redis_server.url, "sched-hit", lookup_timeout_ms=2000))
    try:
        put_chunks(cache, 2, range(2))
        side = side_with(cache)
        req = request("r", PROMPT)
        first = side.get_num_new_matched_tokens(req, 0)
        assert first == (None, False) or first == (2 * CHUNK, False)  # in flight, or answered at once
        assert ask_until_answered(side, req) == (2 * CHUNK, False)
        assert side.stats.num_remote_lookups == 1  # one batched check for both chunks and both ranks
        assert outcomes(side) == {"answered": 1.0}
        side.update_state_after_alloc(req, 2 * CHUNK)
        meta = side.build_connector_meta(output([new_req("r", list(range(10, 17)), 0)], {"r": len(PROMPT) - 2 * CHUNK}))
        assert [t.block_ids for t in meta.loads] == [(10, 11), (12, 13)]
        assert len(meta.loads[0].keys) == 2  # one key per rank
    finally:
        cache.close()


def test_a_chunk_missing_on_one_rank_stops_the_hit(redis_server: RedisServer) -> None:
    cache = open_remote(redis_settings(redis_server.url, "sched-rank", lookup_timeout_ms=2000))
    try:
        put_chunks(cache, 2, range(1))  # rank 0 only
        side = side_with(cache)
        assert ask_until_answered(side, request("r", PROMPT)) == (0, False)
    finally:
        cache.close()


def test_the_remote_lookup_starts_after_the_local_hit(redis_server: RedisServer) -> None:
    cache = open_remote(redis_settings(redis_server.url, "sched-local", lookup_timeout_ms=2000))
    try:
        put_chunks(cache, 3, range(2))
        side = side_with(cache)
        first_chunk = [k.digest for r in range(2) for k in rank_keys(PROMPT, r, world_size=2)[:1]]
        side.directory.prepare_receive([rank_keys(PROMPT, r, world_size=2)[0] for r in range(2)], 0, "cpu")
        side.update_from_workers(stored({0: first_chunk[:1], 1: first_chunk[1:]}, layout_tags={0: TAG, 1: TAG}))
        # 3 chunks, but at least one token is computed: 96 of 106 tokens are loadable.
        assert ask_until_answered(side, request("r", PROMPT)) == (3 * CHUNK, False)
        assert side.stats.num_remote_hit_chunks == 2  # chunk 0 came from the local index
    finally:
        cache.close()


def test_a_store_that_is_down_never_stalls_the_scheduler() -> None:
    cache = open_remote(redis_settings(f"redis://127.0.0.1:{free_port()}", "sched-down", lookup_timeout_ms=50))
    try:
        side = side_with(cache)
        started = time.perf_counter()
        answer = ask_until_answered(side, request("r", PROMPT))
        assert answer == (0, False)
        assert time.perf_counter() - started < 1.0
        assert sum(outcomes(side).values()) == 1 and "answered" not in outcomes(side)  # a timeout or unavailable
        calls = time.perf_counter()
        side.get_num_new_matched_tokens(request("r2", PROMPT), 0)
        assert time.perf_counter() - calls < 0.05  # each call returns at once, answered or not
    finally:
        cache.close()

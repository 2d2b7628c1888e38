"""Scheduler side with vLLM's KV cache groups (hybrid manager on): keys, hits, loads and saves per group."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from placement_helpers import directory, dropped
from test_scheduler_side import BLOCK, CHUNK, TAG, key_space, output, request, store_all

from lmi_cache.keys.kv_groups import KvCacheGroup
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata, LmiWorkerMeta
from lmi_cache.vllm_connector.scheduler_side import SchedulerGeometry, SchedulerSide

# Blocks of 16 tokens, chunks of 32. A window of 40 tokens: a request resumed at token H keeps blocks from
# (H - 39) // 16 on (vLLM's SlidingWindowManager); the full-attention group keeps every block.
SLIDING = KvCacheGroup(0, ("layers.0", "layers.2"), 40)
FULL = KvCacheGroup(1, ("layers.1", "layers.3"))
PROMPT = list(range(1, 141))  # 140 tokens: 4 full chunks, 9 blocks


def make_side(*groups: KvCacheGroup) -> SchedulerSide:
    side = SchedulerSide(SchedulerGeometry(BLOCK, CHUNK, 1, groups=groups), key_space(1), directory(CHUNK))
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG}))
    return side


def new_req(req_id: str, per_group: list[list[int]], num_computed: int) -> Any:
    return SimpleNamespace(req_id=req_id, block_ids=tuple(per_group), num_computed_tokens=num_computed)


def warm(side: SchedulerSide, groups: int) -> LmiConnectorMetadata:
    req = request("w", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, 0)
    blocks = [list(range(100 * (g + 1), 100 * (g + 1) + 9)) for g in range(groups)]
    meta = side.build_connector_meta(output([new_req("w", blocks, 0)], {"w": len(PROMPT)}))
    store_all(side, meta)
    side.request_finished("w")
    return meta


def test_every_group_saves_its_chunks_under_its_own_keys() -> None:
    side = make_side(SLIDING, FULL)
    meta = warm(side, groups=2)
    assert [(t.group, t.block_ids) for t in meta.saves] == [
        (0, (100, 101)), (1, (200, 201)), (0, (102, 103)), (1, (202, 203)),
        (0, (104, 105)), (1, (204, 205)), (0, (106, 107)), (1, (206, 207)),
    ]
    digests = {t.keys[0].digest for t in meta.saves}
    assert len(digests) == 8  # the group is in the key namespace: same tokens, different keys


def test_sliding_group_loads_only_its_window_before_the_hit() -> None:
    side = make_side(SLIDING, FULL)
    warm(side, groups=2)
    req = request("r", PROMPT)
    # 4 chunks held, at most 139 tokens: 128 tokens (block aligned), loaded between steps (two groups).
    assert side.get_num_new_matched_tokens(req, 0) == (128, True)
    # vLLM gives the sliding group null blocks (id 0) before block (128 - 39) // 16 = 5.
    sliding_ids = [0] * 5 + [15, 16, 17, 18]
    full_ids = list(range(20, 29))
    side.update_state_after_alloc(req, 128, block_ids=(sliding_ids, full_ids))
    meta = side.build_connector_meta(output([], {}))  # the request waits for its KV: not scheduled
    assert meta.async_loads == ["r"]
    loads = [(t.group, t.block_ids, t.block_offset) for t in meta.loads]
    assert [load for load in loads if load[0] == 0] == [(0, (15,), 1), (0, (16, 17), 0)]
    assert [load for load in loads if load[0] == 1] == [
        (1, (20, 21), 0), (1, (22, 23), 0), (1, (24, 25), 0), (1, (26, 27), 0)
    ]
    # Once loaded, vLLM schedules it from token 128: nothing is loaded again, the stored chunks are not re-saved.
    side.update_state_after_alloc(req, 0)
    again = side.build_connector_meta(output([new_req("r", [sliding_ids, full_ids], 128)], {"r": 12}))
    assert not again.loads and not again.saves and not again.async_loads


def test_mistral_shape_hits_after_its_early_chunks_are_evicted() -> None:
    side = make_side(KvCacheGroup(0, ("layers.0",), 40))
    meta = warm(side, groups=1)
    # Evict the first two chunks: a window of 40 before token 128 only needs chunks 2 and 3.
    side.update_from_workers(dropped({0: [t.keys[0].digest for t in meta.saves[:2]]}, layout_tags={0: TAG}))
    assert side.get_num_new_matched_tokens(request("r", PROMPT), 0) == (128, True)


def test_a_full_group_without_its_early_chunks_misses() -> None:
    side = make_side(SLIDING, FULL)
    meta = warm(side, groups=2)
    full_chunk_0 = next(t for t in meta.saves if t.group == 1)
    side.update_from_workers(dropped({0: [full_chunk_0.keys[0].digest]}, layout_tags={0: TAG}))
    assert side.get_num_new_matched_tokens(request("r", PROMPT), 0) == (0, False)


def test_blocks_vllm_freed_or_nulled_are_never_saved() -> None:
    side = make_side(SLIDING, FULL)
    req = request("c", PROMPT)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, 0)
    # Chunked prefill: the first step computes 80 tokens (chunks 0 and 1 complete).
    first = side.build_connector_meta(output([new_req("c", [list(range(10, 15)), list(range(30, 35))], 0)], {"c": 80}))
    assert sorted((t.group, t.block_ids) for t in first.saves) == [(0, (10, 11)), (0, (12, 13)), (1, (30, 31)), (1, (32, 33))]
    # The next step starts at 80: vLLM has freed sliding blocks before (80 - 39) // 16 = 2; chunk 2 (blocks 4, 5)
    # completes now and its blocks are still held, chunk 3 too.
    cached = SimpleNamespace(req_ids=["c"], resumed_req_ids=set(), new_block_ids=[([15, 16, 17, 18], [35, 36, 37, 38])],
                             num_computed_tokens=[80])
    second = side.build_connector_meta(output([], {"c": 60}, cached))
    assert sorted((t.group, t.block_ids) for t in second.saves) == [(0, (14, 15)), (0, (16, 17)), (1, (34, 35)), (1, (36, 37))]


def test_a_chunk_whose_sliding_blocks_were_freed_mid_chunk_is_not_saved() -> None:
    side = make_side(KvCacheGroup(0, ("layers.0",), 16), FULL)
    req = request("n", PROMPT)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, 0)
    side.build_connector_meta(output([new_req("n", [list(range(10, 18)), list(range(30, 38))], 0)], {"n": 127}))
    # Chunk 3 (blocks 6, 7) completes in the step that starts at 127; with a 16-token window vLLM freed
    # every block before (127 - 15) // 16 = 7 at that step's start, block 6 included: its id may hold
    # another request's KV, so only the full-attention group's chunk 3 is saved.
    cached = SimpleNamespace(req_ids=["n"], resumed_req_ids=set(), new_block_ids=[([18], [38])],
                             num_computed_tokens=[127])
    meta = side.build_connector_meta(output([], {"n": 13}, cached))
    assert [(t.group, t.block_ids) for t in meta.saves] == [(1, (36, 37))]


def test_single_full_group_keeps_the_keys_of_the_group_unaware_scheme() -> None:
    side = make_side(KvCacheGroup(0, ("layers.0", "layers.1")))
    meta = warm(side, groups=1)
    assert [t.keys[0] for t in meta.saves] == key_space(1)(TAG).keys(PROMPT, 0)

"""Scheduler-side bookkeeping of LmiCacheConnector, driven with small fake vLLM objects."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.keys import hashing as chunk_hashing
from lmi_cache.keys.hashing import ChunkKey, KeySpace
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata, LmiWorkerMeta
from lmi_cache.vllm_connector.scheduler_side import MAX_ASKS_WITHOUT_LAYOUT, SchedulerGeometry, SchedulerSide
from placement_helpers import directory, dropped, stored

BLOCK, CHUNK = 16, 32
TAG = "cpu.s0123.float32"


def key_space(world_size: int) -> Callable[[str], KeySpace]:
    """The factory the connector hands the scheduler: layout tag -> KeySpace (TP = world_size)."""
    return lambda tag: KeySpace(model="m", kv_dtype="float32", layout=tag, chunk_size=CHUNK, tp_size=world_size)


def rank_keys(tokens: list[int], rank: int, world_size: int) -> list[ChunkKey]:
    """What a scheduler of ``world_size`` ranks keys rank ``rank``'s chunks with (no LoRA, no salt)."""
    return key_space(world_size)(TAG).keys(tokens, rank)


def make_side(world_size: int = 1, min_retrieve: int = 0, layout_known: bool = True) -> SchedulerSide:
    side = SchedulerSide(SchedulerGeometry(BLOCK, CHUNK, world_size, min_retrieve), key_space(world_size), directory(CHUNK))
    if layout_known:
        side.update_from_workers(LmiWorkerMeta(layout_tags={r: TAG for r in range(world_size)}))
    return side


def request(req_id: str, tokens: list[int], salt: str | None = None, lora: str | None = None, num_output: int = 0) -> Any:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        num_tokens=len(tokens) + num_output,
        cache_salt=salt,
        lora_request=SimpleNamespace(lora_name=lora) if lora else None,
    )


def new_req(req_id: str, block_ids: list[int], num_computed: int) -> Any:
    return SimpleNamespace(req_id=req_id, block_ids=(block_ids,), num_computed_tokens=num_computed)


def output(new: Sequence[Any] = (), scheduled: dict[str, int] | None = None, cached: Any = None,
           preempted: set[str] | None = None) -> Any:
    cached = cached or SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled or {},
        finished_req_ids=set(),
        preempted_req_ids=preempted,
    )


def store_all(side: SchedulerSide, meta: LmiConnectorMetadata) -> None:
    by_rank: dict[int, list[bytes]] = {}
    for t in meta.saves:
        for rank, k in enumerate(t.keys):
            by_rank.setdefault(rank, []).append(k.digest)
    side.update_from_workers(stored(by_rank, layout_tags={0: TAG}))


def planned_hit(side: SchedulerSide, tokens: list[int], hit_tokens: int, block_ids: list[int], scheduled: int,
                req_id: str = "r") -> LmiConnectorMetadata:
    """A repeat of stored tokens: checks the hit vLLM is told, allocates it, returns the step's plan."""
    req = request(req_id, tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (hit_tokens, False)
    side.update_state_after_alloc(req, hit_tokens)
    return side.build_connector_meta(output([new_req(req_id, block_ids, hit_tokens)], {req_id: scheduled}))


def warm(side: SchedulerSide, tokens: list[int], req_id: str = "w") -> LmiConnectorMetadata:
    req = request(req_id, tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, 0)
    blocks = list(range(100, 100 + -(-len(tokens) // BLOCK)))
    meta = side.build_connector_meta(output([new_req(req_id, blocks, 0)], {req_id: len(tokens)}))
    store_all(side, meta)
    side.request_finished(req_id)
    return meta


PROMPT = list(range(1, 76))  # 75 tokens: 2 full chunks + a partial one


def test_cold_prefill_saves_full_chunks_only() -> None:
    side = make_side()
    meta = warm(side, PROMPT)
    assert not meta.loads
    assert [t.block_ids for t in meta.saves] == [(100, 101), (102, 103)]
    assert side.num_tracked_requests == 0


def test_warm_request_loads_leading_chunks_block_aligned() -> None:
    side = make_side()
    warm(side, PROMPT)
    meta = planned_hit(side, PROMPT, 64, [7, 8, 9, 10, 11], scheduled=11)
    assert [(t.block_ids, t.block_offset) for t in meta.loads] == [((7, 8), 0), ((9, 10), 0)]
    assert not meta.saves  # both full chunks are already stored
    assert side.stats.num_load_tokens == 64


def test_full_hit_leaves_a_token_to_compute() -> None:
    side = make_side()
    tokens = PROMPT[:64]
    warm(side, tokens)
    req = request("r", tokens)
    n, is_async = side.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (48, False)  # 63 rounded down to a block
    assert n is not None
    side.update_state_after_alloc(req, n)
    meta = side.build_connector_meta(output([new_req("r", [1, 2, 3, 4], 48)], {"r": 16}))
    assert [(t.block_ids, t.block_offset) for t in meta.loads] == [((1, 2), 0), ((3,), 0)]
    assert not meta.saves


def test_prefix_cache_covered_part_is_not_reloaded() -> None:
    side = make_side()
    warm(side, PROMPT)
    req = request("r", PROMPT)
    assert side.get_num_new_matched_tokens(req, 16) == (48, False)
    side.update_state_after_alloc(req, 48)
    meta = side.build_connector_meta(output([new_req("r", [5, 6, 7, 8, 9], 64)], {"r": 11}))
    assert [(t.block_ids, t.block_offset) for t in meta.loads] == [((6,), 1), ((7, 8), 0)]
    assert side.get_num_new_matched_tokens(request("q", PROMPT), 64) == (0, False)


def test_chunked_prefill_saves_each_chunk_once_complete() -> None:
    side = make_side()
    req = request("r", PROMPT)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, 0)
    m1 = side.build_connector_meta(output([new_req("r", [1, 2], 0)], {"r": 24}))
    cached = SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[([3, 4],)], num_computed_tokens=[24])
    m2 = side.build_connector_meta(output(cached=cached, scheduled={"r": 30}))
    cached = SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[([5],)], num_computed_tokens=[54])
    m3 = side.build_connector_meta(output(cached=cached, scheduled={"r": 21}))
    assert m1.saves == []
    assert [t.block_ids for t in m2.saves] == [(1, 2)]
    assert [t.block_ids for t in m3.saves] == [(3, 4)]


def test_salt_and_lora_namespaces_never_share() -> None:
    side = make_side()
    warm(side, PROMPT)
    assert side.get_num_new_matched_tokens(request("a", PROMPT, salt="tenant-b"), 0) == (0, False)
    assert side.get_num_new_matched_tokens(request("b", PROMPT, lora="adapter"), 0) == (0, False)
    assert side.get_num_new_matched_tokens(request("c", PROMPT), 0) == (64, False)


def test_unknown_layout_defers_then_gives_up() -> None:
    side = make_side(layout_known=False)
    req = request("r", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    for _ in range(MAX_ASKS_WITHOUT_LAYOUT):
        side.get_num_new_matched_tokens(req, 0)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)


def test_layout_disagreement_disables_lookups() -> None:
    side = make_side(world_size=2)
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG, 1: "flash_nhd.s01234.float32"}))
    assert side.get_num_new_matched_tokens(request("r", PROMPT), 0) == (0, False)


def test_min_retrieve_tokens() -> None:
    side = make_side(min_retrieve=65)
    warm(side, PROMPT)
    assert side.get_num_new_matched_tokens(request("r", PROMPT), 0) == (0, False)


def test_removed_digests_make_a_miss() -> None:
    side = make_side()
    meta = warm(side, PROMPT)
    side.update_from_workers(dropped({0: [meta.saves[1].keys[0].digest]}))
    assert side.get_num_new_matched_tokens(request("r", PROMPT), 0) == (32, False)


def test_all_ranks_must_hold_a_chunk() -> None:
    side = make_side(world_size=2)
    req = request("w", PROMPT)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, 0)
    meta = side.build_connector_meta(output([new_req("w", [1, 2, 3, 4, 5], 0)], {"w": 75}))
    assert all(len(t.keys) == 2 and t.keys[0].digest != t.keys[1].digest for t in meta.saves)
    side.update_from_workers(stored({0: [t.keys[0].digest for t in meta.saves]}))
    assert side.get_num_new_matched_tokens(request("r", PROMPT), 0) == (0, False)
    side.update_from_workers(stored({1: [meta.saves[0].keys[1].digest]}))
    assert side.get_num_new_matched_tokens(request("r", PROMPT), 0) == (32, False)


def test_a_prompt_is_hashed_once_for_all_ranks(monkeypatch: Any) -> None:
    side = make_side(world_size=4)
    chains: list[int] = []
    real_chain = chunk_hashing._chain
    monkeypatch.setattr(chunk_hashing, "_chain", lambda *args: chains.append(1) or real_chain(*args))
    req = request("w", PROMPT)
    for _ in range(3):  # re-asks while waiting for memory reuse the plan's keys
        side.get_num_new_matched_tokens(req, 0)
    assert len(chains) == 1
    side.update_state_after_alloc(req, 0)
    meta = side.build_connector_meta(output([new_req("w", [1, 2, 3, 4, 5], 0)], {"w": 75}))
    assert [t.keys for t in meta.saves] == [
        tuple(rank_keys(PROMPT, r, world_size=4)[c] for r in range(4)) for c in range(2)
    ]


def test_a_key_space_that_does_not_fit_the_scheduler_disables_lookups() -> None:
    wrong = SchedulerSide(SchedulerGeometry(BLOCK, CHUNK, 2), key_space(4), directory(CHUNK))
    wrong.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG, 1: TAG}))
    assert not warm(wrong, PROMPT).saves
    assert wrong.get_num_new_matched_tokens(request("r", PROMPT), 0) == (0, False)


def test_concurrent_identical_prompts_save_once() -> None:
    side = make_side()
    reqs = [request(f"r{i}", PROMPT) for i in range(3)]
    for req in reqs:
        side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, 0)
    news = [new_req(f"r{i}", [10 * i + j for j in range(5)], 0) for i in range(3)]
    meta = side.build_connector_meta(output(news, {f"r{i}": 75 for i in range(3)}))
    assert len(meta.saves) == 2 and {t.req_id for t in meta.saves} == {"r0"}


def test_preempted_request_replans_on_resume() -> None:
    side = make_side()
    warm(side, PROMPT)
    req = request("r", PROMPT)
    side.update_state_after_alloc(req, side.get_num_new_matched_tokens(req, 0)[0] or 0)
    side.build_connector_meta(output([new_req("r", [1, 2, 3, 4, 5], 64)], {"r": 11}))
    side.build_connector_meta(output(preempted={"r"}))
    resumed = request("r", PROMPT, num_output=3)
    n, _ = side.get_num_new_matched_tokens(resumed, 0)
    assert n == 64
    side.update_state_after_alloc(resumed, n)
    cached = SimpleNamespace(req_ids=["r"], resumed_req_ids={"r"}, new_block_ids=[([9, 8, 7, 6, 5],)], num_computed_tokens=[64])
    meta = side.build_connector_meta(output(cached=cached, scheduled={"r": 14}))
    assert [t.block_ids for t in meta.loads] == [(9, 8), (7, 6)]


def test_finished_requests_drop_their_plan() -> None:
    side = make_side()
    req = request("r", PROMPT)
    side.get_num_new_matched_tokens(req, 0)
    assert side.num_tracked_requests == 1
    out = output()
    out.finished_req_ids = {"r"}
    side.build_connector_meta(out)
    assert side.num_tracked_requests == 0


@settings(max_examples=150, deadline=None)
@given(
    prompt_len=st.integers(1, 200),
    num_outputs=st.integers(0, 5),
    stored_chunks=st.integers(0, 7),
    local_blocks=st.integers(0, 13),
    min_retrieve=st.sampled_from([0, 0, 16, 40]),
)
def test_match_invariants(prompt_len: int, num_outputs: int, stored_chunks: int, local_blocks: int, min_retrieve: int) -> None:
    side = make_side(min_retrieve=min_retrieve)
    tokens = [(i * 7919) % 1000 for i in range(prompt_len)]
    all_keys = rank_keys(tokens, 0, world_size=1)
    side.update_from_workers(stored({0: [k.digest for k in all_keys[:stored_chunks]]}))
    req = request("r", tokens, num_output=num_outputs)
    num_computed = min(local_blocks * BLOCK, ((req.num_tokens - 1) // BLOCK) * BLOCK)
    n, is_async = side.get_num_new_matched_tokens(req, num_computed)
    assert is_async is False and n is not None and n >= 0
    hit_end = num_computed + n
    if n:
        assert n >= min_retrieve
        assert hit_end % BLOCK == 0 and hit_end <= req.num_tokens - 1
        assert hit_end <= min(stored_chunks, len(all_keys)) * CHUNK
        side.update_state_after_alloc(req, n)
        blocks = list(range(1000, 1000 + -(-req.num_tokens // BLOCK)))
        meta = side.build_connector_meta(output([new_req("r", blocks, hit_end)], {"r": req.num_tokens - hit_end}))
        loaded = [b for t in meta.loads for b in t.block_ids]
        assert loaded == blocks[num_computed // BLOCK : hit_end // BLOCK]


# -- metrics: lookups are counted where they happen, once per admission -------------------------------


def counted(side: SchedulerSide) -> tuple[float | None, ...]:
    value = side.metrics.registry.get_sample_value
    return tuple(value(f"lmi_cache_{name}_total", {"engine": side.metrics.engine_label})
                 for name in ("lookups", "requested_tokens", "hit_tokens", "load_tokens"))


def test_lookups_and_hits_are_counted_by_the_scheduler() -> None:
    """The connector's real call sequence moves the lookup counters (they stayed 0 under vLLM before)."""
    side = make_side()
    warm(side, PROMPT)
    assert counted(side) == (1, 75, 0, 0)  # the cold request: a lookup, no hit
    req = request("r", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (64, False)
    side.update_state_after_alloc(req, 64)
    assert counted(side) == (2, 150, 64, 64)


def test_re_asks_while_waiting_for_memory_count_once() -> None:
    side = make_side()
    warm(side, PROMPT)
    req = request("r", PROMPT)
    for _ in range(5):  # vLLM asks again every step until blocks are free
        assert side.get_num_new_matched_tokens(req, 0) == (64, False)
    side.update_state_after_alloc(req, 64)
    assert counted(side) == (2, 150, 64, 64)


def test_hit_covered_by_vllms_prefix_cache_is_a_hit_but_not_a_load() -> None:
    side = make_side()
    warm(side, PROMPT)
    req = request("r", PROMPT)
    assert side.get_num_new_matched_tokens(req, 64) == (0, False)  # vLLM's own prefix cache had it all
    side.update_state_after_alloc(req, 0)
    assert counted(side) == (2, 150, 64, 0)


def test_requests_never_admitted_are_not_counted() -> None:
    side = make_side()
    req = request("r", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.request_finished("r")  # aborted while waiting
    side.update_state_after_alloc(req, 0)  # (not a real vLLM sequence: nothing left to count)
    assert counted(side) == (None, None, None, None)


def test_admission_after_preemption_is_a_new_lookup() -> None:
    side = make_side()
    warm(side, PROMPT)
    req = request("r", PROMPT)
    for _ in range(2):
        assert side.get_num_new_matched_tokens(req, 0) == (64, False)
        side.update_state_after_alloc(req, 64)
        side.build_connector_meta(output(preempted={"r"}))
    assert counted(side) == (3, 225, 128, 128)


def test_disabled_or_layoutless_lookups_count_as_misses() -> None:
    disabled = make_side(world_size=2, layout_known=False)
    disabled.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG, 1: "other"}))
    req = request("r", PROMPT)
    assert disabled.get_num_new_matched_tokens(req, 0) == (0, False)
    disabled.update_state_after_alloc(req, 0)
    assert counted(disabled) == (1, 75, 0, 0)
    layoutless = make_side(layout_known=False)
    for _ in range(MAX_ASKS_WITHOUT_LAYOUT):
        assert layoutless.get_num_new_matched_tokens(req, 0) == (None, False)
    layoutless.update_state_after_alloc(req, 0)  # a re-ask answer is not a lookup
    assert counted(layoutless) == (None, None, None, None)
    assert layoutless.get_num_new_matched_tokens(req, 0) == (0, False)
    layoutless.update_state_after_alloc(req, 0)
    assert counted(layoutless) == (1, 75, 0, 0)


def test_min_retrieve_tokens_hit_below_the_threshold_is_no_hit() -> None:
    side = make_side(min_retrieve=96)
    warm(side, PROMPT)
    req = request("r", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, 0)
    assert counted(side)[2] == 0


def test_a_hit_asks_the_directory_once_per_chunk_and_the_load_reuses_the_answer() -> None:
    side = make_side()
    warm(side, PROMPT)
    asked: list[bytes] = []
    lookup = side.directory.lookup

    def counting(keys: Sequence[ChunkKey]) -> str | None:
        asked.append(keys[0].digest)
        return lookup(keys)

    side.directory.lookup = counting  # type: ignore[method-assign]
    meta = planned_hit(side, PROMPT, 2 * CHUNK, [1, 2, 3, 4, 5], len(PROMPT) - 2 * CHUNK)
    assert [t.source for t in meta.loads] == ["cpu", "cpu"]
    assert sorted(asked) == sorted(k.digest for k in rank_keys(PROMPT, 0, 1))  # each chunk once, no second lookup


def test_the_metadata_says_when_every_rank_s_layout_and_sizes_arrived() -> None:
    side = make_side(world_size=2, layout_known=False)
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG}, chunk_bytes={0: {0: 64}}))
    meta = side.build_connector_meta(output())
    side.finish_step(meta)
    assert not meta.layout_known  # rank 1 has not reported
    side.update_from_workers(LmiWorkerMeta(layout_tags={1: TAG}, chunk_bytes={1: {0: 64}}))
    meta = side.build_connector_meta(output())
    side.finish_step(meta)
    assert meta.layout_known and side.layout_tag == TAG

"""Scheduler side with a Mamba state group (hybrid models): state saves from vLLM's offers, one state load per hit."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from placement_helpers import dropped
from test_scheduler_groups import PROMPT, make_side, new_req
from test_scheduler_side import BLOCK, CHUNK, TAG, output, request, store_all

from lmi_cache.keys.kv_groups import KvCacheGroup
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata

# Blocks of 16 tokens, chunks of 32: vLLM's Mamba group (0) keeps the state after (p + 1) * 16 tokens in block p.
STATE = KvCacheGroup(0, ("layers.0.mixer", "layers.2.mixer"), state_shapes=((3, 8), (2, 4, 4)),
                     state_dtypes=("float32", "float32"))
FULL = KvCacheGroup(1, ("layers.1.attn", "layers.3.attn"))


def with_offers(out: Any, offers: dict[str, list[tuple[int, int, int]]]) -> Any:
    """A scheduler output while build_connector_meta runs: vLLM's boundary-state hand-offs of this step."""
    out.kv_connector_block_state = SimpleNamespace(boundary_state_offloads=offers)
    return out


def warm(side: Any) -> LmiConnectorMetadata:
    """A 140-token prompt in one step; vLLM offers its states at every block boundary (retention interval 16)."""
    req = request("w", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, 0)
    offers = {"w": [(0, 500 + p, (p + 1) * BLOCK) for p in range(len(PROMPT) // BLOCK)]}
    blocks = [[0] * 8 + [508], list(range(200, 209))]
    meta = side.build_connector_meta(with_offers(output([new_req("w", blocks, 0)], {"w": len(PROMPT)}), offers))
    store_all(side, meta)
    side.request_finished("w")
    return meta


def test_states_are_saved_from_the_offered_blocks_at_chunk_boundaries_only() -> None:
    side = make_side(STATE, FULL)
    meta = warm(side)
    # Offers at 16, 32, ..., 128: the chunk ends (32, 64, 96, 128) are kept, each from exactly its offered block.
    assert [(t.group, t.block_ids) for t in meta.saves if t.group == 0] == [(0, (501,)), (0, (503,)), (0, (505,)),
                                                                          (0, (507,))]
    assert [t.block_ids for t in meta.saves if t.group == 1] == [(200, 201), (202, 203), (204, 205), (206, 207)]
    # A state is keyed like the chunk that ends at its boundary, in its own group's namespace.
    state_digests = {t.keys[0].digest for t in meta.saves if t.group == 0}
    assert len(state_digests) == 4 and not state_digests & {t.keys[0].digest for t in meta.saves if t.group == 1}
    assert side.stats.num_planned_saves == 8


def test_no_offer_means_no_state_save_and_a_state_is_saved_once() -> None:
    side = make_side(STATE, FULL)
    warm(side)
    req = request("again", PROMPT)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, 0)  # admitted without a load: the same boundaries offered again
    offers = {"again": [(0, 601, 32), (0, 0, 64), (1, 602, 96)], "unknown": [(0, 603, 32)]}
    meta = side.build_connector_meta(with_offers(output([new_req("again", [[0] * 9, list(range(9))], 0)],
                                                         {"again": 140}), offers))
    assert meta.saves == []  # held already; a null block or a non-state group is never a state


def test_a_hit_loads_every_attention_chunk_and_one_state_into_its_block() -> None:
    side = make_side(STATE, FULL)
    stored_at_128 = next(t.keys for t in warm(side).saves if t.group == 0 and t.block_ids == (507,))
    req = request("r", PROMPT)
    # 4 chunks and the state at 128 held; at most 139 tokens: 128, loaded between steps.
    assert side.get_num_new_matched_tokens(req, 0) == (128, True)
    # vLLM allocates the Mamba group's block at index 128 // 16 - 1 = 7 only (the rest are null blocks).
    state_ids, full_ids = [0] * 7 + [77], list(range(20, 29))
    side.update_state_after_alloc(req, 128, block_ids=(state_ids, full_ids))
    meta = side.build_connector_meta(with_offers(output([], {}), {}))
    assert meta.async_loads == ["r"]
    assert [(t.group, t.block_ids, t.block_offset) for t in meta.loads if t.group == 0] == [(0, (77,), 0)]
    assert [t.block_ids for t in meta.loads if t.group == 1] == [(20, 21), (22, 23), (24, 25), (26, 27)]
    assert next(t.keys for t in meta.loads if t.group == 0) == stored_at_128


def test_a_missing_state_moves_the_hit_to_an_earlier_chunk_boundary() -> None:
    side = make_side(STATE, FULL)
    meta = warm(side)
    at_128 = next(t for t in meta.saves if t.group == 0 and t.block_ids == (507,))
    side.update_from_workers(dropped({0: [at_128.keys[0].digest]}, layout_tags={0: TAG}))
    # The state at 96 is the deepest one held: a hit there, not at the block boundary 112.
    assert side.get_num_new_matched_tokens(request("r", PROMPT), 0) == (96, True)


def test_without_a_state_block_nothing_of_the_request_is_loaded() -> None:
    side = make_side(STATE, FULL)
    warm(side)
    req = request("r", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (128, True)
    side.update_state_after_alloc(req, 128, block_ids=([0] * 8, list(range(20, 29))))
    meta = side.build_connector_meta(output([], {}))
    # Attention KV without its state would resume the request on a state nobody wrote: nothing is loaded,
    # and the worker answers the waiting request failed (vLLM recomputes it).
    assert meta.loads == [] and meta.async_loads == ["r"]


def test_a_blended_request_saves_no_state() -> None:
    side = make_side(STATE, FULL)
    req = request("b", PROMPT)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, 0, saves=False)
    meta = side.build_connector_meta(with_offers(output([new_req("b", [[0] * 9, list(range(9))], 0)], {"b": 140}),
                                                 {"b": [(0, 501, 32)]}))
    assert meta.saves == []


def test_boundaries_past_the_prompt_chunks_are_not_saved() -> None:
    side = make_side(STATE, FULL)
    req = request("d", PROMPT, num_output=30)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, 0)
    side.build_connector_meta(output([new_req("d", [[0] * 9, list(range(9))], 0)], {"d": 140}))
    cached = SimpleNamespace(req_ids=["d"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[160])
    meta = side.build_connector_meta(with_offers(output([], {"d": 1}, cached), {"d": [(0, 509, 160)]}))
    assert meta.saves == []  # 160 tokens: a decoded boundary, past the prompt's 140 // CHUNK = 4 full chunks

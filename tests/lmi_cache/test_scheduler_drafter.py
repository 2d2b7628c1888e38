"""Scheduler planning with speculative decoding: the drafter's back-off on hits, and saves of verified prompt
tokens only (vLLM-free: small fake vLLM objects, as in test_scheduler_side)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lmi_cache.keys.kv_groups import KvCacheGroup
from lmi_cache.vllm_connector.request_plan import SchedulerGeometry, usable_hit_tokens
from lmi_cache.vllm_connector.scheduler_side import SchedulerSide
from lmi_cache.vllm_connector.startup import drafter_identity, drafter_planning
from lmi_cache.metrics.scheduler_series import SchedulerMetrics
from lmi_cache.vllm_connector.metadata import LmiWorkerMeta
from placement_helpers import directory
from test_scheduler_side import BLOCK, CHUNK, PROMPT, TAG, key_space, new_req, output, planned_hit, request, warm

FULL = KvCacheGroup(0, ())
STATE = KvCacheGroup(1, ("layers.0.mixer",), state_shapes=((3, 8),), state_dtypes=("float32",))


def drafter_side(backoff: int = BLOCK, tail: int = 0) -> SchedulerSide:
    geo = SchedulerGeometry(BLOCK, CHUNK, 1, drafter_backoff_tokens=backoff, unfinal_tail_tokens=tail)
    side = SchedulerSide(geo, key_space(1), directory(CHUNK), SchedulerMetrics())
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG}))
    return side


def cached_step(req_id: str, num_computed: int, new_blocks: list[int]) -> Any:
    return SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[(new_blocks,)],
                           num_computed_tokens=[num_computed])


@pytest.mark.parametrize(("backoff", "max_tokens", "want"), [
    (0, 74, 64),  # no drafter: every held chunk
    (BLOCK, 74, 48),  # EAGLE: one block less, so the drafter's KV of token 47 is rewritten
    (BLOCK, 63, 32),  # a full hit is capped first (48), then backs off
    (BLOCK, 16, 0),  # nothing is left after the back-off
])
def test_a_drafter_backs_a_full_attention_hit_off_by_one_block(backoff: int, max_tokens: int, want: int) -> None:
    geo = SchedulerGeometry(BLOCK, CHUNK, 1, drafter_backoff_tokens=backoff)
    assert usable_hit_tokens(geo, 2, max_tokens, lambda g, c: True) == want


def test_a_state_group_backs_off_to_the_previous_chunk_boundary_it_holds() -> None:
    geo = SchedulerGeometry(BLOCK, CHUNK, 1, groups=(FULL, STATE), drafter_backoff_tokens=BLOCK)
    held_states = {0, 1}  # states after chunks 0 and 1 (boundaries 32 and 64)
    assert usable_hit_tokens(geo, 3, 200, lambda g, c: g == 0 or c in held_states) == 32
    assert usable_hit_tokens(geo, 3, 200, lambda g, c: g == 0 or c == 1) == 0


def test_min_retrieve_applies_after_the_back_off() -> None:
    geo = SchedulerGeometry(BLOCK, CHUNK, 1, min_retrieve_tokens=64, drafter_backoff_tokens=BLOCK)
    assert usable_hit_tokens(geo, 4, 200, lambda g, c: c < 4) == 112
    assert usable_hit_tokens(geo, 2, 200, lambda g, c: True) == 0


def test_an_eagle_hit_loads_up_to_the_block_before_its_last_one() -> None:
    side = drafter_side()
    warm(side, PROMPT)
    meta = planned_hit(side, PROMPT, 48, [7, 8, 9, 10, 11], scheduled=27)
    # Chunk 1 is loaded in part: only its first block; its second is recomputed (drafter KV included).
    assert [(t.block_ids, t.block_offset) for t in meta.loads] == [((7, 8), 0), ((9,), 0)]
    assert not meta.saves  # chunk 1 is stored already
    assert side.stats.num_load_tokens == 48


def test_a_prompt_sharing_only_the_prefix_loads_one_block_less() -> None:
    side = drafter_side()
    warm(side, PROMPT[:64])  # chunk 1's last token was followed by the first generated token
    other = PROMPT[:64] + [999] * 20
    assert side.get_num_new_matched_tokens(request("r", other), 0) == (48, False)


def test_decode_steps_save_no_draft_tokens_or_lookahead_slots() -> None:
    side = drafter_side()
    tokens = PROMPT[:64]  # exactly two chunks
    req = request("r", tokens)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, 0)
    prefill = side.build_connector_meta(output([new_req("r", [1, 2, 3, 4, 5, 6], 0)], {"r": 64}))
    assert [t.block_ids for t in prefill.saves] == [(1, 2), (3, 4)]
    # A decode step verifying 3 draft tokens in freshly allocated lookahead blocks: nothing past the prompt.
    decode = side.build_connector_meta(output(cached=cached_step("r", 64, [7, 8]), scheduled={"r": 4}))
    assert decode.saves == [] and decode.loads == []


def test_multi_module_mtp_saves_a_chunk_once_its_reprefilled_tail_is_past_it() -> None:
    side = drafter_side(tail=2)
    req = request("r", PROMPT)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, 0)
    first = side.build_connector_meta(output([new_req("r", [1, 2], 0)], {"r": 33}))
    assert first.saves == []  # tokens 31 and 32 are re-prefilled next step
    second = side.build_connector_meta(output(cached=cached_step("r", 33, [3, 4, 5]), scheduled={"r": 42}))
    assert [t.block_ids for t in second.saves] == [(1, 2), (3, 4)]


def spec_config(method: str, block_drop: bool = True, draft: Any = None) -> Any:
    eagle = method in ("eagle", "eagle3", "mtp")
    return SimpleNamespace(method=method, num_speculative_tokens=2, draft_model_config=draft,
                           use_eagle=lambda: eagle, use_eagle_block_drop=lambda: eagle and block_drop,
                           uses_draft_model=lambda: method == "draft_model")


def vllm_config(spec: Any, prefill_lookahead: int = 0) -> Any:
    return SimpleNamespace(speculative_config=spec, num_prefill_lookahead_tokens=prefill_lookahead,
                           load_config=SimpleNamespace(download_dir=None))


def test_drafter_planning_mirrors_vllms_prefix_cache() -> None:
    assert drafter_planning(vllm_config(None), 128) == (0, 0)
    assert drafter_planning(vllm_config(spec_config("ngram")), 128) == (0, 0)
    assert drafter_planning(vllm_config(spec_config("eagle"), prefill_lookahead=1), 128) == (128, 0)
    assert drafter_planning(vllm_config(spec_config("eagle", block_drop=False), 1), 128) == (0, 0)
    assert drafter_planning(vllm_config(spec_config("mtp"), prefill_lookahead=3), 128) == (128, 2)


def test_the_drafter_is_in_the_keys_only_when_it_has_kv_layers(tmp_path: Any) -> None:
    from lmi_cache.keys.model_identity import served_model_identity

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"head-a")
    head = SimpleNamespace(model=str(tmp_path), revision=None, dtype="float32", quantization=None, hf_overrides=None)
    assert drafter_identity(vllm_config(None)) == ""
    assert drafter_identity(vllm_config(spec_config("ngram"))) == ""
    eagle = drafter_identity(vllm_config(spec_config("eagle", draft=head)))
    assert eagle == f"|drafter=eagle:2:{served_model_identity(head)}"
    assert eagle != drafter_identity(vllm_config(spec_config("eagle3", draft=head)))

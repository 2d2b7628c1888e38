"""Per-tier hit tokens and the reason of each miss, on the scheduler's series (no vLLM)."""
from __future__ import annotations

from typing import Any

from lmi_cache.metrics.scheduler_series import SchedulerMetrics
from lmi_cache.placement.book import TierSpec
from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.placement.messages import TierEvent
from lmi_cache.vllm_connector.metadata import LmiWorkerMeta
from lmi_cache.vllm_connector.scheduler_side import SchedulerGeometry, SchedulerSide
from test_scheduler_side import BLOCK, CHUNK, TAG, key_space, new_req, output, request

PROMPT = list(range(1, 76))  # 75 tokens: two full chunks (64 tokens) can be served, at most 74 rounded to 64


def side_with(cpu_chunks: int = 8, disk_chunks: int = 0) -> SchedulerSide:
    specs = [TierSpec("cpu", cpu_chunks * 100, lambda b: b), TierSpec("disk", disk_chunks * 100, lambda b: b)]
    metrics = SchedulerMetrics()  # one set of series for the scheduler and its directory, as the connector builds them
    directory = PlacementDirectory(specs, chunk_tokens=CHUNK, write_through=("disk",), metrics=metrics)
    directory.sizes.set_chunk_bytes(0, 0, 100)
    side = SchedulerSide(SchedulerGeometry(BLOCK, CHUNK, 1), key_space(1), directory, metrics)
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG}))
    return side


def admit(side: SchedulerSide, req_id: str, tokens: list[int], gpu_hit: int = 0) -> Any:
    """Look a request up (vLLM's own cache holding ``gpu_hit`` tokens), admit it, plan its step, store its saves."""
    req = request(req_id, tokens)
    matched, _ = side.get_num_new_matched_tokens(req, gpu_hit)
    side.update_state_after_alloc(req, matched or 0)
    blocks = list(range(100, 100 + -(-len(tokens) // BLOCK)))
    meta = side.build_connector_meta(output([new_req(req_id, blocks, gpu_hit)], {req_id: len(tokens) - gpu_hit}))
    side.finish_step(meta)
    landed = [TierEvent(tier, t.keys[0].digest) for t in meta.saves for tier in t.tiers]  # every planned store lands
    side.update_from_workers(LmiWorkerMeta(stored={0: landed}))
    side.request_finished(req_id)
    return meta


def sample(side: SchedulerSide, name: str, **labels: str) -> float:
    return side.metrics.registry.get_sample_value(name, {"engine": "0", **labels}) or 0.0


def test_a_cold_prompt_misses_as_not_stored_and_a_warm_one_hits_the_cpu_tier() -> None:
    side = side_with()
    admit(side, "a", PROMPT)
    assert sample(side, "lmi_cache_miss_tokens_total", reason="not_stored") == 64
    admit(side, "b", PROMPT)
    assert sample(side, "lmi_cache_tier_hit_tokens_total", tier="cpu") == 64
    assert sample(side, "lmi_cache_miss_tokens_total", reason="not_stored") == 64  # nothing more missed


def test_the_disk_tier_is_credited_for_what_it_serves_and_vllm_for_its_own_hit() -> None:
    side = side_with(cpu_chunks=2, disk_chunks=8)
    admit(side, "a", PROMPT)
    admit(side, "b", [t + 1000 for t in PROMPT])  # the CPU tier (two chunks) gives the first prompt up
    admit(side, "c", PROMPT, gpu_hit=BLOCK)  # vLLM holds its first block; the rest comes from disk
    assert sample(side, "lmi_cache_tier_hit_tokens_total", tier="gpu") == BLOCK
    assert sample(side, "lmi_cache_tier_hit_tokens_total", tier="disk") == 64 - BLOCK
    assert sample(side, "lmi_cache_tier_hit_tokens_total", tier="cpu") == 0


def test_a_miss_on_an_evicted_chunk_says_evicted() -> None:
    side = side_with(cpu_chunks=2)
    admit(side, "a", PROMPT)
    admit(side, "b", [t + 1000 for t in PROMPT])  # evicts both chunks of the first prompt (no disk tier)
    admit(side, "c", PROMPT)
    assert sample(side, "lmi_cache_miss_tokens_total", reason="evicted") == 64
    assert sample(side, "lmi_cache_miss_tokens_total", reason="not_stored") == 128  # the two cold prompts


def test_failed_loads_and_key_mismatches_are_counted_from_the_workers_reports() -> None:
    side = side_with()
    meta = admit(side, "a", PROMPT)
    digest = meta.saves[0].keys[0].digest
    side.update_from_workers(LmiWorkerMeta(dropped={0: [TierEvent("cpu", digest, reason="key_mismatch")]}))
    side.update_from_workers(LmiWorkerMeta(dropped={0: [TierEvent("cpu", meta.saves[1].keys[0].digest,
                                                                  reason="failed_load")]}))
    assert sample(side, "lmi_cache_miss_tokens_total", reason="key_mismatch") == CHUNK
    assert sample(side, "lmi_cache_miss_tokens_total", reason="failed_load") == CHUNK

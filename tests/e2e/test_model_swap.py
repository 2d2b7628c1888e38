"""Weights replaced in place never reuse the old weights' KV from the disk tier.

Model A (seed 1) fills a disk tier; then the weights of the suite's tiny model
(seed 0, same architecture and size) are copied over A's weight file at the
same path, and a fresh vLLM process with the same disk tier serves them. The
scheduler's index is seeded with A's persisted chunks, yet nothing may hit:
the keys carry the identity of the weights. Outputs must equal the suite's
reference run of the tiny model without the connector (the session
``baseline``, which other modules need anyway: this module adds two vLLM
starts).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    CHUNK_TOKENS,
    DOCS,
    assert_same_outputs,
    cache_env,
    expected_hit_tokens,
    gen_phase,
    phase,
    prompts,
    run_job,
)

FULL_CHUNKS = sum(len(doc) // CHUNK_TOKENS for doc in DOCS)
LOADABLE_CHUNKS = sum(expected_hit_tokens(len(doc)) // CHUNK_TOKENS for doc in DOCS)


@pytest.fixture(scope="module")
def swap_runs(tiny_model: Path, e2e_dir: Path) -> dict[str, Any]:
    from lmi_cache.devtools.tiny_model import make_tiny_model

    served = make_tiny_model(e2e_dir / "swap-served", "7m", seed=1)  # model A at the served path
    disk = e2e_dir / "swap-disk"
    disk.mkdir(mode=0o700, exist_ok=True)
    first = run_job(
        {"model": str(served), "connector": True, "disk_dir": str(disk), "env": cache_env(disk),
         "phases": [gen_phase("fill", prompts(DOCS))]},
        e2e_dir / "swap-a",
    )
    # Redeploy: the tiny model's weights over A's, same file name, same directory, same size.
    weights = served / "model.safetensors"
    assert weights.stat().st_size == (tiny_model / "model.safetensors").stat().st_size
    shutil.copyfile(tiny_model / "model.safetensors", weights)
    after = run_job(
        {"model": str(served), "connector": True, "disk_dir": str(disk), "env": cache_env(disk),
         "phases": [gen_phase("swapped", prompts(DOCS)), gen_phase("again", prompts(DOCS))]},
        e2e_dir / "swap-after",
    )
    return {"first": first, "after": after}


def test_replaced_weights_miss_and_match_the_new_model(swap_runs: dict[str, Any], baseline: dict[str, Any]) -> None:
    filled = phase(swap_runs["first"], "fill")
    swapped = phase(swap_runs["after"], "swapped")
    reference = phase(baseline, "docs")
    assert filled["counters"]["worker.num_chunks_saved"] == FULL_CHUNKS  # A's KV is on disk
    # Every prompt missed (counted by vLLM itself), nothing was loaded, yet A's chunks were in the index.
    assert [o["num_cached_tokens"] for o in swapped["outputs"]] == [0] * len(DOCS)
    assert swapped["delta"].get("worker.num_chunks_loaded", 0) == 0
    assert swapped["delta"].get("worker.num_load_faults", 0) == 0
    assert swapped["counters"]["scheduler.placed_digests"] >= 2 * FULL_CHUNKS  # A's seeded + the new ones
    assert_same_outputs(swapped, reference)
    # The swap mattered: A answers differently (else this test could not tell stale KV apart).
    assert [o["tokens"] for o in filled["outputs"]] != [o["tokens"] for o in reference["outputs"]]


def test_cache_works_again_for_the_new_weights(swap_runs: dict[str, Any], baseline: dict[str, Any]) -> None:
    again = phase(swap_runs["after"], "again")
    assert again["delta"]["worker.num_chunks_loaded"] == LOADABLE_CHUNKS
    assert_same_outputs(again, phase(baseline, "docs_again"))

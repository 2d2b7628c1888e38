"""LmiCacheConnector on real vLLM (CPU, float32): identical outputs cold and warm, real hits."""
from __future__ import annotations

import os
from typing import Any

from e2e_support import (
    DOCS,
    PARTIAL,
    PARTIAL_SHARED_TOKENS,
    SALTED,
    assert_same_outputs,
    expected_hit_tokens,
    phase,
)


def test_cold_run_matches_no_connector(baseline: dict[str, Any], connector_run: dict[str, Any]) -> None:
    cold = phase(connector_run, "cold")
    assert_same_outputs(cold, phase(baseline, "docs"))
    assert all(o["num_cached_tokens"] == 0 for o in cold["outputs"])
    # Every full chunk of the 8 prompts was saved once.
    assert cold["delta"]["worker.num_chunks_saved"] == sum(n // 256 for n in map(len, DOCS))


def test_warm_run_of_8_concurrent_requests_hits_and_matches(baseline: dict[str, Any], connector_run: dict[str, Any]) -> None:
    warm = phase(connector_run, "warm")
    assert len(warm["outputs"]) == 8
    assert_same_outputs(warm, phase(baseline, "docs_again"))
    # The reference itself hit vLLM's prefix cache at the same tokens.
    assert [o["num_cached_tokens"] for o in phase(baseline, "docs_again")["outputs"]] == [
        o["num_cached_tokens"] for o in warm["outputs"]
    ]
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == [expected_hit_tokens(len(d)) for d in DOCS]
    assert warm["delta"]["worker.num_chunks_loaded"] >= sum(expected_hit_tokens(len(d)) // 256 for d in DOCS)
    assert warm["delta"]["worker.num_load_faults"] == 0
    assert warm["delta"]["worker.num_chunks_saved"] == 0


def test_partial_prefix_reuse(baseline: dict[str, Any], connector_run: dict[str, Any]) -> None:
    part = phase(connector_run, "partial")
    assert_same_outputs(part, phase(baseline, "partial"))
    want = [expected_hit_tokens(len(p), shared) for p, shared in zip(PARTIAL, PARTIAL_SHARED_TOKENS)]
    assert [o["num_cached_tokens"] for o in part["outputs"]] == want
    assert want[0] == 512 and want[1] == 256 and want[2] == 0


def test_different_cache_salts_never_share(baseline: dict[str, Any], connector_run: dict[str, Any]) -> None:
    ref = phase(baseline, "salted")
    for name in ("salt_a", "salt_b", "salt_a_again"):
        assert_same_outputs(phase(connector_run, name), ref)
    assert phase(connector_run, "salt_a")["outputs"][0]["num_cached_tokens"] == 0
    assert phase(connector_run, "salt_b")["outputs"][0]["num_cached_tokens"] == 0
    assert phase(connector_run, "salt_b")["delta"]["worker.num_chunks_loaded"] == 0
    assert phase(connector_run, "salt_a_again")["outputs"][0]["num_cached_tokens"] == expected_hit_tokens(len(SALTED))


def test_layout_tag_reported_by_worker(connector_run: dict[str, Any]) -> None:
    tag = phase(connector_run, "cold")["counters"]["worker.layout_tag"]
    assert tag.startswith("cpu.") and tag.endswith("float32")


def test_jobs_copy_with_the_kernels_the_environment_asks_for(connector_run: dict[str, Any]) -> None:
    # conftest sets LMI_CACHE_KERNELS=native unless the caller chose: CI exercises the native kernels.
    assert phase(connector_run, "cold")["counters"]["worker.kernels"] == os.environ["LMI_CACHE_KERNELS"]


def test_save_cost_is_small(connector_run: dict[str, Any]) -> None:
    """The gather on the step is a small fraction of the cold prefill (measured, reported)."""
    cold = phase(connector_run, "cold")
    per_chunk_s = cold["delta"]["worker.save_seconds"] / cold["delta"]["worker.num_chunks_saved"]
    print(f"save cost: {per_chunk_s * 1e3:.2f} ms per 256-token chunk; cold phase {cold['elapsed_s']:.2f} s")
    assert cold["delta"]["worker.save_seconds"] < 0.25 * cold["elapsed_s"]

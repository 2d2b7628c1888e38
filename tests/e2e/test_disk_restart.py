"""A fresh vLLM process reloads from the disk tier; corrupt files and a stale index only cost recompute.

This process runs with vLLM's own prefix caching on (the production default),
so it also covers requests that vLLM's cache partly holds: the connector then
loads only the chunks beyond vLLM's hit.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    DOCS,
    PARTIAL,
    SALTED,
    assert_same_outputs,
    cache_env,
    expected_hit_tokens,
    gen_phase,
    phase,
    prompts,
    run_job,
)


@pytest.fixture(scope="module")
def restart_run(tiny_model: Path, e2e_dir: Path, disk_dir: Path, connector_run: dict[str, Any]) -> dict[str, Any]:
    assert connector_run["phases"], "the first connector process must have filled the disk tier"
    job = {
        "model": str(tiny_model),
        "connector": True,
        "disk_dir": str(disk_dir),
        "env": cache_env(disk_dir),
        "llm_kwargs": {"enable_prefix_caching": True},
        "phases": [
            # Puts DOCS[7]'s first 2 blocks into vLLM's own prefix cache (loaded from disk).
            gen_phase("short", prompts([DOCS[7][:300]])),
            gen_phase("reload", prompts(DOCS)),
            # SALTED (tenant-a) chunks are only on disk in this process: corrupt them.
            gen_phase("corrupt", prompts([SALTED], salt="tenant-a"), before=["corrupt_disk"]),
            # Drop the engine's contents behind the scheduler's back: the index is now stale.
            # PARTIAL[0] and [2] have chunks of their own beyond vLLM's local hit.
            gen_phase("stale", prompts(PARTIAL), before=["clear_engine"]),
        ],
    }
    return run_job(job, e2e_dir / "restart")


def test_fresh_process_reloads_from_disk(baseline: dict[str, Any], restart_run: dict[str, Any]) -> None:
    short = phase(restart_run, "short")
    assert short["outputs"][0]["num_cached_tokens"] == 256
    reload = phase(restart_run, "reload")
    assert_same_outputs(reload, phase(baseline, "docs_again"))
    assert [o["num_cached_tokens"] for o in reload["outputs"]] == [expected_hit_tokens(len(d)) for d in DOCS]
    assert reload["delta"]["worker.num_load_faults"] == 0
    assert reload["delta"].get("engine.disk_loads", 0) > 0, reload["counters"]


def test_load_beyond_vllm_own_prefix_hit(restart_run: dict[str, Any]) -> None:
    """DOCS[7]: 256 tokens from vLLM's prefix cache, the next 1024 loaded by the connector."""
    reload = phase(restart_run, "reload")
    loaded_chunks = sum(expected_hit_tokens(len(d)) // 256 for d in DOCS) - 1
    assert reload["delta"]["worker.num_chunks_loaded"] == loaded_chunks
    assert reload["delta"]["scheduler.num_load_tokens"] == sum(expected_hit_tokens(len(d)) for d in DOCS) - 256


def test_corrupted_disk_files_are_recomputed(baseline: dict[str, Any], restart_run: dict[str, Any]) -> None:
    corrupt = phase(restart_run, "corrupt")
    assert_same_outputs(corrupt, phase(baseline, "salted"))
    assert corrupt["delta"]["worker.num_load_faults"] > 0


def test_stale_index_is_recomputed(baseline: dict[str, Any], restart_run: dict[str, Any]) -> None:
    stale = phase(restart_run, "stale")
    # The recompute runs in another batch than the reference; vLLM CPU's float32 logprobs
    # move by ~1e-5 with batch composition (no cache involved), so they get a tolerance.
    assert_same_outputs(stale, phase(baseline, "partial"), logprob_atol=1e-4)
    assert stale["delta"]["worker.num_load_faults"] >= 2

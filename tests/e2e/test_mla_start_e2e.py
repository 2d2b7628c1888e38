"""An MLA model on vLLM's CPU backend with the connector: refused at start in one line (one vLLM start, ~30 s).

A tiny DeepSeek-V2-shaped config (two layers, the MLA latent of 512 + 64 the CPU MLA kernel requires, MoE)
with vLLM's dummy weights: vLLM builds the model and its ``MLAAttentionSpec`` KV cache group, and the
connector refuses it naming the latent layers, instead of serving without its KV cached or failing later.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_support import JobFailed, gen_phase, prompts, run_job

pytestmark = pytest.mark.vllm

TINY_DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64, "v_head_dim": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
    "norm_topk_prob": False, "scoring_func": "softmax", "routed_scaling_factor": 1.0, "max_position_embeddings": 2048,
    "vocab_size": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
}


def test_a_deepseek_v2_shape_is_refused_at_start_naming_its_latent_layers(e2e_dir: Path) -> None:
    model = e2e_dir / "tiny-deepseek-v2"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_DEEPSEEK_V2))
    job = {
        "model": str(model),
        "connector": True,
        "env": {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "true", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.1"},
        # The CPU MLA kernel runs in bfloat16; no weights or tokenizer files: vLLM's dummy weights, token ids in.
        "llm_kwargs": {"dtype": "bfloat16", "load_format": "dummy", "skip_tokenizer_init": True,
                       "max_model_len": 1024},
        "phases": [gen_phase("never", prompts([list(range(2, 300))]))],
    }
    with pytest.raises(JobFailed) as err:
        run_job(job, e2e_dir / "mla-start")
    assert err.value.returncode != 0
    assert ("ConfigError: KV cache group 0 (MLAAttentionSpec) holds 2 MLA latent layers of 1,152 B per token: "
            "lmi-cache's connector does not store MLA caches") in err.value.output

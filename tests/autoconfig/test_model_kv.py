"""config.json -> KvLayout: published model geometries, vLLM dtype rules, refusals."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoconfig.model.kv import HybridModelError, ModelConfigError, kv_layout_from_config
from lmi_cache.errors import UserError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "config.json").read_text())


# Published geometry per model (model cards / papers), KV dtype 2 bytes (bf16):
# (fixture, attention layers, KV heads, head_dim, is_mla)
PUBLISHED = [
    ("llama-3.1-8b-instruct", 32, 8, 128, False),
    ("llama-3.3-70b-instruct", 80, 8, 128, False),
    ("qwen2.5-0.5b-instruct", 24, 2, 64, False),
    ("qwen2.5-7b-instruct", 28, 4, 128, False),
    ("qwen2.5-72b-instruct", 80, 8, 128, False),
    ("qwen3-8b", 36, 8, 128, False),
    ("qwen3-30b-a3b", 48, 4, 128, False),
    ("mistral-7b-v0.1", 32, 8, 128, False),
    ("gemma-2-9b-it", 42, 8, 256, False),  # head_dim 256 although 3584 / 16 = 224
    ("gemma-3-27b-it", 62, 16, 128, False),  # text_config of a VLM
    ("falcon-7b", 32, 1, 64, False),  # multi_query: one KV head, 4544 / 71 = 64
    ("deepseek-v3", 61, 1, 512 + 64, True),  # MLA latent: kv_lora_rank + qk_rope_head_dim
]


def expected_per_rank(layers: int, kv_heads: int, head_dim: int, is_mla: bool, tp: int, pp: int) -> int:
    stage_layers = math.ceil(layers / pp)
    if is_mla:  # the latent is replicated on every TP rank
        return stage_layers * head_dim * 2
    return stage_layers * 2 * max(1, kv_heads // tp) * head_dim * 2


@pytest.mark.parametrize("name,layers,kv_heads,head_dim,is_mla", PUBLISHED)
def test_published_geometry(name: str, layers: int, kv_heads: int, head_dim: int, is_mla: bool) -> None:
    info = kv_layout_from_config(load(name), source=name)
    lay = info.layout
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.is_mla) == (layers, kv_heads, head_dim, is_mla)
    assert lay.kv_dtype == "bfloat16" and info.model_dtype == "bfloat16"
    per_token = layers * head_dim * 2 if is_mla else layers * 2 * kv_heads * head_dim * 2
    assert lay.kv_bytes_per_token == per_token
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            assert lay.kv_bytes_per_token_per_rank(tp, pp) == expected_per_rank(
                layers, kv_heads, head_dim, is_mla, tp, pp), (tp, pp)


def test_hand_computed_figures() -> None:
    llama = kv_layout_from_config(load("llama-3.1-8b-instruct")).layout
    assert llama.kv_bytes_per_token == 131072  # 32 x 2 x 8 x 128 x 2
    assert llama.kv_bytes_per_token_per_rank(8, 1) == 16384
    ds = kv_layout_from_config(load("deepseek-v3")).layout
    assert ds.kv_bytes_per_token == 70272  # 61 x 576 x 2
    assert ds.kv_bytes_per_token_per_rank(8, 1) == 70272  # replicated on each TP rank
    assert ds.kv_bytes_per_token_per_rank(1, 2) == 35712  # 31 layers on the fuller stage
    qwen05 = kv_layout_from_config(load("qwen2.5-0.5b-instruct")).layout
    assert qwen05.kv_bytes_per_token_per_rank(4, 1) == 24 * 2 * 1 * 64 * 2  # 2 KV heads replicated over 4


def test_notes_explain_the_derivation() -> None:
    notes = kv_layout_from_config(load("llama-3.1-8b-instruct")).notes
    assert "head_dim 128 = hidden_size 4096 / num_attention_heads 32" in notes
    assert any(n.startswith("KV dtype bfloat16") for n in notes)
    gemma = kv_layout_from_config(load("gemma-2-9b-it"))
    assert any("head_dim 256 given explicitly" in n for n in gemma.notes)
    assert gemma.sliding_window == 4096 and any("sliding window 4096" in n for n in gemma.notes)


def test_max_position_and_sliding_window() -> None:
    mistral = kv_layout_from_config(load("mistral-7b-v0.1"))
    assert mistral.max_position_embeddings == 32768 and mistral.sliding_window == 4096
    assert any("every layer" in n for n in mistral.notes)
    qwen = kv_layout_from_config(load("qwen2.5-7b-instruct"))  # use_sliding_window false
    assert qwen.sliding_window is None and qwen.max_position_embeddings == 32768
    assert kv_layout_from_config(load("deepseek-v3")).max_position_embeddings == 163840


def test_text_config_and_other_nestings() -> None:
    gemma3 = kv_layout_from_config(load("gemma-3-27b-it"))
    assert gemma3.sliding_window == 1024
    assert any("text_config" in n for n in gemma3.notes)
    inner = load("llama-3.1-8b-instruct")
    for key in ("llm_config", "language_config"):
        wrapped = {"model_type": "internvl_chat", "torch_dtype": "float16", key: inner}
        info = kv_layout_from_config(wrapped)
        assert info.layout.kv_bytes_per_token == 131072 and info.model_dtype == "float16"


def test_mha_default_and_falcon_new_architecture() -> None:
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert kv_layout_from_config(cfg).layout.num_kv_heads == 4
    falcon40 = {"model_type": "falcon", "num_hidden_layers": 60, "num_attention_heads": 128, "hidden_size": 8192,
                "new_decoder_architecture": True, "multi_query": True, "num_kv_heads": 8}
    assert kv_layout_from_config(falcon40).layout.num_kv_heads == 8


# --- dtype resolution (vllm/config/model.py _get_and_verify_dtype, CUDA platform) ---

def with_dtype(name: str, **keys: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(load(name))
    cfg.pop("torch_dtype", None)
    cfg.update(keys)
    return cfg


@pytest.mark.parametrize("config_dtype,bf16,expected", [
    ("float32", True, "bfloat16"),  # float32 checkpoints are downcast
    ("float32", False, "float16"),  # pre-Ampere GPUs: no bf16
    ("float16", True, "float16"),
    ("bfloat16", True, "bfloat16"),
    ("bfloat16", False, "float16"),  # unsupported on the device: fallback
])
def test_auto_dtype(config_dtype: str, bf16: bool, expected: str) -> None:
    info = kv_layout_from_config(with_dtype("llama-3.1-8b-instruct", torch_dtype=config_dtype), bf16_supported=bf16)
    assert info.model_dtype == expected and info.layout.kv_dtype == expected


def test_new_dtype_key_and_missing_dtype() -> None:
    assert kv_layout_from_config(with_dtype("qwen3-8b", dtype="float16")).model_dtype == "float16"
    info = kv_layout_from_config(with_dtype("qwen3-8b"))
    assert info.model_dtype == "bfloat16" and any("names no dtype" in n for n in info.notes)


def test_gemma_never_float16() -> None:
    assert kv_layout_from_config(with_dtype("gemma-2-9b-it", torch_dtype="float16")).model_dtype == "bfloat16"
    with pytest.raises(ModelConfigError, match="float16"):
        kv_layout_from_config(load("gemma-2-9b-it"), dtype="float16")


@pytest.mark.parametrize("dtype,expected", [("half", "float16"), ("float", "float32"), ("BFLOAT16", "bfloat16")])
def test_explicit_dtype(dtype: str, expected: str) -> None:
    info = kv_layout_from_config(load("llama-3.1-8b-instruct"), dtype=dtype)
    assert info.model_dtype == expected and info.layout.kv_dtype == expected
    assert info.layout.kv_bytes_per_token == 32 * 2 * 8 * 128 * (4 if expected == "float32" else 2)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_halves_bytes(kv_dtype: str) -> None:
    lay = kv_layout_from_config(load("llama-3.1-8b-instruct"), kv_cache_dtype=kv_dtype).layout
    assert lay.kv_dtype == kv_dtype and lay.kv_bytes_per_token == 32 * 2 * 8 * 128 * 1
    ds = kv_layout_from_config(load("deepseek-v3"), kv_cache_dtype=kv_dtype).layout
    assert ds.kv_bytes_per_token == 61 * 576


def test_explicit_kv_dtype_differs_from_model_dtype() -> None:
    info = kv_layout_from_config(with_dtype("llama-3.1-8b-instruct", torch_dtype="float16"), kv_cache_dtype="bfloat16")
    assert info.model_dtype == "float16" and info.layout.kv_dtype == "bfloat16"


def test_checkpoint_kv_scheme() -> None:
    fp8 = load("llama-3.1-8b-instruct-fp8-kv")  # compressed-tensors with kv_cache_scheme
    info = kv_layout_from_config(fp8)
    assert info.layout.kv_dtype == "fp8" and info.layout.kv_bytes_per_token == 65536
    assert kv_layout_from_config(fp8, kv_cache_dtype="bfloat16").layout.kv_dtype == "bfloat16"
    no_scheme = copy.deepcopy(fp8)
    no_scheme["quantization_config"]["kv_cache_scheme"] = None
    assert kv_layout_from_config(no_scheme).layout.kv_dtype == "bfloat16"
    # DeepSeek V3 ships fp8 weights (quant_method fp8) but no KV scheme: KV stays bf16.
    assert kv_layout_from_config(load("deepseek-v3")).layout.kv_dtype == "bfloat16"


def test_modelopt_kv_algo() -> None:
    cfg = load("llama-3.1-8b-instruct")
    cfg["quantization_config"] = {"producer": {"name": "modelopt", "version": "0.29.0"},
                                  "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}
    assert kv_layout_from_config(cfg).layout.kv_dtype == "fp8_e4m3"
    cfg["quantization_config"]["quantization"]["kv_cache_quant_algo"] = "NVFP4"
    with pytest.raises(ModelConfigError, match="NVFP4"):
        kv_layout_from_config(cfg)


@pytest.mark.parametrize("bad", ["fp4", "int8", "nvfp4", "turboquant_k8v4", "float32"])
def test_bad_kv_cache_dtype(bad: str) -> None:
    with pytest.raises(ModelConfigError, match="kv_cache_dtype") as err:
        kv_layout_from_config(load("llama-3.1-8b-instruct"), kv_cache_dtype=bad)
    assert "\n" not in str(err.value)


def test_bad_dtype() -> None:
    with pytest.raises(ModelConfigError, match="dtype 'int8'"):
        kv_layout_from_config(load("llama-3.1-8b-instruct"), dtype="int8")


# --- hybrid models: the known kinds are sized (test_plan_hybrid.py), the others refused ---

@pytest.mark.parametrize("extra,key", [
    ({"layers_block_type": ["mamba", "attention"]}, "layers_block_type"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
    ({"attn_layer_period": 8}, "attn_layer_period"),
    ({"mamba_d_state": 16}, "mamba_d_state"),
])
def test_hybrid_markers_refused(extra: dict[str, Any], key: str) -> None:
    cfg = {"model_type": "custom", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, **extra}
    with pytest.raises(HybridModelError, match=key):
        kv_layout_from_config(cfg)


def test_sliding_layer_types_are_not_hybrid() -> None:
    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64,
           "sliding_window": 512, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    info = kv_layout_from_config(cfg)
    assert info.layout.num_layers == 4 and any("3 of 4 layers" in n for n in info.notes)


# --- bad input: one line naming the file and the key ---

@pytest.mark.parametrize("config,key", [
    ({"num_attention_heads": 32, "hidden_size": 4096}, "num_hidden_layers"),
    ({"num_hidden_layers": 32, "hidden_size": 4096}, "num_attention_heads"),
    ({"num_hidden_layers": 32, "num_attention_heads": 7, "hidden_size": 4096}, "hidden_size"),
    ({"num_hidden_layers": "32", "num_attention_heads": 32, "hidden_size": 4096}, "num_hidden_layers"),
    ({"num_hidden_layers": True, "num_attention_heads": 32, "hidden_size": 4096}, "num_hidden_layers"),
    ({"num_hidden_layers": -1, "num_attention_heads": 32, "hidden_size": 4096}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 5, "hidden_size": 4096},
     "num_key_value_heads"),
    ({"text_config": {"num_attention_heads": 8, "hidden_size": 64}}, "text_config.num_hidden_layers"),
])
def test_bad_configs(config: dict[str, Any], key: str) -> None:
    with pytest.raises(ModelConfigError) as err:
        kv_layout_from_config(config, source="/models/x/config.json")
    message = str(err.value)
    assert message.startswith("/models/x/config.json: ") and f"'{key}'" in message and "\n" not in message


@pytest.mark.parametrize("value", [[1, 2], "text", 3, None])
def test_non_object_json(value: Any) -> None:
    with pytest.raises(ModelConfigError, match="expected a JSON object"):
        kv_layout_from_config(value, source="cfg.json")  # type: ignore[arg-type]


@given(layers=st.integers(1, 128), kv_log2=st.integers(0, 4), group=st.integers(1, 8),
       head_dim=st.sampled_from([64, 80, 96, 128, 256]), tp_log2=st.integers(0, 3))
def test_gqa_property(layers: int, kv_log2: int, group: int, head_dim: int, tp_log2: int) -> None:
    kv_heads, tp = 2**kv_log2, 2**tp_log2
    heads = kv_heads * group
    cfg = {"model_type": "llama", "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "hidden_size": heads * head_dim, "torch_dtype": "bfloat16"}
    lay = kv_layout_from_config(cfg).layout
    assert lay.kv_bytes_per_token == layers * 2 * kv_heads * head_dim * 2
    if kv_heads % tp == 0:  # an even head split: the ranks together hold exactly one copy
        assert lay.kv_bytes_per_token_per_rank(tp, 1) * tp == lay.kv_bytes_per_token
    else:  # replicated heads: each rank holds at least its share
        assert lay.kv_bytes_per_token_per_rank(tp, 1) * tp > lay.kv_bytes_per_token

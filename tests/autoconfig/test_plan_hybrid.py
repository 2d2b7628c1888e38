"""Hybrid attention / state-space models (Qwen3-Next, Jamba): state geometry, the planner's sizing, vLLM's flags.

The planner sizes these models as vLLM 0.32's hybrid KV cache manager pools
them and asks vLLM to retain the state at every chunk boundary, where the
connector stores it; with upstream LMCache (``--engine lmcache``) ``plan``
and ``configure`` refuse them in one line. Goldens come from the
planner itself. Regenerate after an intended change with
``LMI_CACHE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/autoconfig/test_plan_hybrid.py``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_cli import HOSTS, MODELS, _golden, _run

from autoconfig.model.kv import HybridModelError, kv_layout_from_config
from autoconfig.model.source import load_model_info
from autoconfig.plan.hybrid import hybrid_block_tokens, hybrid_pool_tokens
from autoconfig.plan.planner import plan_tiers
from autoconfig.plan.settings import ServingSettings
from autoconfig.plan.types import GIB, PlanModel
from autoconfig.probe.snapshot import load_snapshot_file


def _config(name: str) -> dict[str, Any]:
    return json.loads((Path(MODELS) / name / "config.json").read_text())


def test_qwen3_next_state_is_vllms_gated_delta_net_shape() -> None:
    info = kv_layout_from_config(_config("qwen3-next-80b-a3b-instruct"))
    state = info.state
    assert state is not None and state.kind == "gated_delta_net"
    # full_attention_interval 4: layers 3, 7, ..., 47 are attention, the other 36 gated delta nets.
    assert (state.num_attention_layers, state.num_state_layers, info.layout.num_layers) == (12, 36, 12)
    # conv: 2 x 16 key heads x 128 + 32 value heads x 128 = 8,192 channels, kernel 4 keeps 3 tokens.
    assert state.conv_shape() == (3, 8192) and state.ssm_shape() == (32, 128, 128)
    assert state.layer_state_bytes() == (3 * 8192 + 32 * 128 * 128) * 2 == 1_097_728
    assert state.conv_shape(tp=8) == (3, 1024) and state.ssm_shape(tp=8) == (4, 128, 128)
    # Attention KV per token counts the 12 attention layers only: 12 x 2 x 2 KV heads x 256 x 2 B.
    assert info.layout.kv_bytes_per_token == 24_576
    assert info.sliding_window is None


def test_jamba_state_is_vllms_mamba1_shape() -> None:
    info = kv_layout_from_config(_config("jamba-v0.1"))
    state = info.state
    assert state is not None and state.kind == "mamba1"
    # attn_layer_period 8, offset 4: layers 4, 12, 20, 28 are attention.
    assert (state.num_attention_layers, state.num_state_layers) == (4, 28)
    assert state.conv_shape() == (3, 8192) and state.ssm_shape() == (8192, 16)
    assert state.request_state_bytes() == 28 * (3 * 8192 + 8192 * 16) * 2


def test_mamba2_pads_groups_to_the_tensor_parallel_degree() -> None:
    cfg = {"model_type": "granitemoehybrid", "num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 256,
           "num_key_value_heads": 2, "layer_types": ["mamba", "attention", "mamba", "attention"],
           "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_d_conv": 4,
           "mamba_expand": 2}
    state = kv_layout_from_config(cfg).state
    assert state is not None and state.kind == "mamba2"
    assert state.conv_shape() == (3, 512 + 2 * 16) and state.ssm_shape() == (8, 64, 16)
    # One group cannot be split over 2 ranks: vLLM replicates it (2 groups), each rank holds half the channels.
    assert state.conv_shape(tp=2) == (3, (512 + 2 * 2 * 16) // 2)


def test_unknown_hybrid_kinds_are_refused_in_one_line() -> None:
    cfg = {"model_type": "zamba2", "num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 256}
    with pytest.raises(HybridModelError, match="cannot size yet") as err:
        kv_layout_from_config(cfg, source="zamba/config.json")
    assert "\n" not in str(err.value) and str(err.value).startswith("zamba/config.json")


def _tiny_qwen3_next() -> PlanModel:
    # The tiny Qwen3-Next shape measured on vLLM's CPU backend (bfloat16, 2 GiB of KV cache).
    cfg = {"model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 32, "hidden_size": 256, "torch_dtype": "bfloat16",
           "layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_key_heads": 1,
           "linear_num_value_heads": 2, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_conv_kernel_dim": 4}
    info = kv_layout_from_config(cfg)
    return PlanModel(info.layout, 0, state=info.state)


def test_pool_matches_what_vllm_reported_for_the_tiny_model() -> None:
    """vLLM 0.32 CPU logged: block size 384, mamba page padded 43.28%, 10,922 blocks, 3,441,270 tokens at 4,096."""
    m = _tiny_qwen3_next()
    block = hybrid_block_tokens(m, tp=1, base_block=128)
    why: list[str] = []
    assert block == 384
    assert hybrid_pool_tokens(m, 1, 2 * GIB, block, 4096, why) == 3_441_270
    assert "padded by 43.3%" in why[0] and "10,922 blocks" in why[0]


PLAN_CASES = [
    ("plan_qwen3_next_80b_tp4_a100x8", "qwen3-next-80b-a3b-instruct", ServingSettings(tp=4, max_model_len=32768)),
    ("plan_jamba_tp4_a100x8", "jamba-v0.1", ServingSettings(tp=4, max_model_len=65536)),
]


@pytest.mark.parametrize(("name", "model", "settings"), PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_hybrid_plan_golden(name: str, model: str, settings: ServingSettings) -> None:
    info = load_model_info(f"{MODELS}/{model}")
    plan = plan_tiers(load_snapshot_file(f"{HOSTS}/a100x8_nvme_cgroup.json"), info, settings)
    assert plan.chunk_size % plan.gpu.block_size == 0, "chunks end on block boundaries, where states exist"
    assert any(line.startswith("hybrid pool: block_size") for line in plan.explanation)
    assert any(line.startswith("tier bytes per token") for line in plan.explanation)
    _golden(f"{name}.json", json.dumps(plan.to_dict(), indent=2) + "\n")


def test_tiers_count_one_state_per_chunk_and_chunks_outweigh_their_state() -> None:
    info = load_model_info(f"{MODELS}/qwen3-next-80b-a3b-instruct")
    plan = plan_tiers(load_snapshot_file(f"{HOSTS}/a100x8_nvme_cgroup.json"), info, ServingSettings(tp=4))
    assert info.kv.state is not None
    state_bytes = 36 * info.kv.state.layer_state_bytes(tp=4)  # every state layer, one rank
    chunk, kv = plan.chunk_size, plan.kv_bytes_per_token_per_rank
    assert chunk * kv >= state_bytes > (chunk - plan.gpu.block_size) * kv  # the smallest chunk that outweighs it
    # The tier holds whole chunks, each with its attention KV and one state (rounded up to whole bytes per token).
    tier_bytes_per_token = kv + -(-state_bytes // chunk)
    assert plan.cpu.capacity_tokens == plan.cpu.bytes_per_rank // tier_bytes_per_token // chunk * chunk
    assert plan.disk.capacity_tokens == plan.disk.bytes_per_rank // tier_bytes_per_token // chunk * chunk


@pytest.mark.parametrize("model", ["qwen3-next-80b-a3b-instruct", "jamba-v0.1"])
def test_plan_asks_vllm_for_a_state_at_every_chunk_boundary(model: str) -> None:
    result = _run(["plan", "--model", f"{MODELS}/{model}", "--host-snapshot", f"{HOSTS}/a100x8_nvme_cgroup.json", "--tp", "4",
                   "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    args = plan["vllm_args"]
    chunk = plan["chunk_size"]
    assert args[args.index("--prefix-cache-retention-interval") + 1] == str(chunk)
    assert "--max-num-batched-tokens" not in args  # CUDA's Mamba kernels export states inside a prefill step


def test_cpu_backend_mamba2_prefills_one_block_per_step() -> None:
    from types import SimpleNamespace

    from autoconfig.plan.hybrid import hybrid_vllm_args

    why: list[str] = []
    mamba2 = SimpleNamespace(state=SimpleNamespace(kind="mamba2"))  # Granite 4 hybrid's state kind
    assert hybrid_vllm_args(mamba2, "cpu", 128, 256, why) == [  # type: ignore[arg-type]
        "--prefix-cache-retention-interval", "256", "--max-num-batched-tokens", "128"]
    assert hybrid_vllm_args(mamba2, "cuda", 400, 800, why) == [  # type: ignore[arg-type]
        "--prefix-cache-retention-interval", "800"]
    assert len(why) == 3 and hybrid_vllm_args(SimpleNamespace(state=None), "cpu", 128, 256, why) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["qwen3-next-80b-a3b-instruct", "jamba-v0.1"])
def test_plan_for_upstream_lmcache_refuses_in_one_line(model: str) -> None:
    result = _run(["plan", "--model", f"{MODELS}/{model}", "--host-snapshot", f"{HOSTS}/a100x8_nvme_cgroup.json",
                   "--engine", "lmcache"])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert "lmi-cache configures for its own connector only: set option.lmcache_engine=lmi_cache" in result.output

"""Renderers: LMCache dict/YAML (loads with lmi_cache.config.cache_config) and vLLM arguments."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st
from plan_helpers import GIB, LLAMA8B, disk, host

from autoconfig.plan.planner import plan_tiers
from autoconfig.render.lmcache_yaml import gib_2dp_floor, lmcache_dict, render_yaml
from autoconfig.render.vllm_args import vllm_args
from autoconfig.plan.settings import ServingSettings
from lmi_cache.config.cache_config import config_from_dict, load_config


def _plan(**kw: object):
    return plan_tiers(host(2, 700, disks=[disk("/nvme", free_gib=3000, total_gib=4000)]), LLAMA8B,
                      ServingSettings(tp=2, **kw))  # type: ignore[arg-type]


def test_lmcache_dict_loads_in_our_engine_config() -> None:
    plan = _plan()
    data = lmcache_dict(plan)
    cfg, warnings = config_from_dict(data, "plan")
    assert warnings == []
    assert cfg.chunk_size == plan.chunk_size
    assert cfg.local_cpu is True
    assert cfg.max_local_cpu_size == data["max_local_cpu_size"]
    assert cfg.max_local_cpu_size * GIB <= plan.cpu.bytes_per_rank
    assert cfg.local_disk == ("/nvme/lmcache",)
    assert cfg.max_local_disk_size * GIB <= plan.disk.bytes_per_rank
    assert cfg.use_odirect is True


def test_yaml_text_round_trips_and_loads_from_file(tmp_path: Path) -> None:
    plan = _plan()
    text = render_yaml(plan.lmcache_config, header="line one\nline two")
    assert text.startswith("# line one\n# line two\n")
    assert yaml.safe_load(text) == plan.lmcache_config
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    cfg, _ = load_config(str(path), env={})
    assert cfg.max_local_disk_size == plan.lmcache_config["max_local_disk_size"]
    assert list(plan.lmcache_config) == ["chunk_size", "local_cpu", "max_local_cpu_size", "local_disk",
                                         "max_local_disk_size", "extra_config"]


def test_disabled_tiers_render_off() -> None:
    plan = plan_tiers(host(1, 40), LLAMA8B, ServingSettings())
    data = lmcache_dict(plan)
    assert data["local_cpu"] is False and data["max_local_cpu_size"] == 0.0
    assert "local_disk" not in data and data["max_local_disk_size"] == 0.0
    assert data["extra_config"] == {"use_odirect": False}
    config_from_dict(data, "plan")


@given(st.integers(min_value=0, max_value=1 << 50))
def test_gib_2dp_floor_never_rounds_up(num_bytes: int) -> None:
    gib = gib_2dp_floor(num_bytes)
    assert gib * GIB <= num_bytes + 1e-6 * GIB
    assert num_bytes / GIB - gib < 0.01 + 1e-9


def test_vllm_args_connector_json() -> None:
    args = vllm_args(None, ServingSettings())
    assert args[0] == "--kv-transfer-config"
    assert json.loads(args[1]) == {"kv_connector": "LmiCacheConnector",
                                   "kv_connector_module_path": "lmi_cache.vllm_connector", "kv_role": "kv_both"}
    assert len(args) == 2


def test_vllm_args_upstream_lmcache_engine() -> None:
    args = vllm_args(None, ServingSettings(engine="lmcache"))
    assert json.loads(args[1]) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    plan = _plan(engine="lmcache")
    assert plan.env == {"PYTHONHASHSEED": "0"} and "LMCacheConnectorV1" in plan.vllm_args[1]
    assert _plan().env == {}


def test_vllm_args_carry_the_settings_the_plan_assumed() -> None:
    s = ServingSettings(tp=4, pp=2, dp=2, max_model_len=8192, gpu_memory_utilization=0.8,
                        kv_cache_dtype="fp8", dtype="bfloat16")
    args = vllm_args(None, s)
    flags = dict(zip(args[2::2], args[3::2]))
    assert flags == {"--tensor-parallel-size": "4", "--pipeline-parallel-size": "2", "--data-parallel-size": "2",
                     "--max-model-len": "8192", "--gpu-memory-utilization": "0.8", "--kv-cache-dtype": "fp8",
                     "--dtype": "bfloat16"}

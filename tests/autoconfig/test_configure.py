"""The container-start step: properties + env -> plan -> files, all or nothing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from plan_helpers import disk, host

from autoconfig.serve.configure import ConfigureError, configure, cpu_kvcache_space_from_env
from autoconfig.lmi.properties import PropertiesError
from lmi_cache.config.cache_config import load_config
from lmi_cache.errors import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
HOST = host(1, 400, disks=[disk("/nvme", free_gib=2000, total_gib=3000)])


def _model_dir(tmp_path: Path, properties: str | None) -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir()
    shutil.copy(FIXTURES / "llama-3.1-8b-instruct" / "config.json", mdir / "config.json")
    if properties is not None:
        (mdir / "serving.properties").write_text(properties)
    return mdir


def test_auto_mode_writes_all_files(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=true\noption.max_model_len=16384\n")
    out = tmp_path / "out"
    result = configure(mdir, out, {}, host=HOST)
    assert result.mode == "auto"
    assert sorted(p.name for p in out.iterdir()) == ["env.json", "env.sh", "lmcache.yaml", "plan.json",
                                                    "vllm_args.json"]
    cfg, warnings = load_config(str(out / "lmcache.yaml"), env={})
    assert result.plan is not None
    assert cfg.max_local_cpu_size == result.plan.lmcache_config["max_local_cpu_size"] > 0
    assert cfg.local_disk == ("/nvme/lmcache",)
    args = json.loads((out / "vllm_args.json").read_text())
    assert args[0] == "--kv-transfer-config" and "--max-model-len" in args
    env = json.loads((out / "env.json").read_text())
    assert env == {"LMCACHE_CONFIG_FILE": str(out / "lmcache.yaml")}
    assert f"export LMCACHE_CONFIG_FILE={out / 'lmcache.yaml'}" in (out / "env.sh").read_text()
    assert json.loads((out / "plan.json").read_text())["model"]["kv_bytes_per_token"] == 131072
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_env_options_work_without_serving_properties(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, None)
    result = configure(mdir, tmp_path / "out", {"OPTION_LMCACHE_AUTO_CONFIG": "True"}, host=HOST)
    assert result.mode == "auto"


def test_cpu_backend_env_carries_kvcache_space(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=true\noption.max_model_len=8192\n")
    cpu_host = host(0, 100, disks=[])
    result = configure(mdir, tmp_path / "out", {"VLLM_CPU_KVCACHE_SPACE": "3"}, host=cpu_host)
    assert result.env["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_file_mode_points_at_user_config(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_config_file=my.yaml\n")
    (mdir / "my.yaml").write_text("chunk_size: 256\nmax_local_cpu_size: 2\n")
    out = tmp_path / "out"
    result = configure(mdir, out, {}, host=HOST)
    assert result.mode == "file" and result.env == {"LMCACHE_CONFIG_FILE": str(mdir / "my.yaml")}
    assert not (out / "lmcache.yaml").exists()


def test_file_mode_with_bad_user_config_writes_nothing(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_config_file=my.yaml\n")
    (mdir / "my.yaml").write_text("chunk_sise: 512\n")
    with pytest.raises(ConfigError, match="chunk_size"):
        configure(mdir, tmp_path / "out", {}, host=HOST)
    assert not (tmp_path / "out").exists()
    (mdir / "my.yaml").unlink()
    with pytest.raises(ConfigureError, match="does not exist"):
        configure(mdir, tmp_path / "out", {}, host=HOST)


def test_off_mode_has_no_connector_and_removes_stale_files(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=true\n")
    out = tmp_path / "out"
    configure(mdir, out, {}, host=HOST)
    (mdir / "serving.properties").write_text("option.tensor_parallel_degree=1\n")
    result = configure(mdir, out, {}, host=HOST)
    assert result.mode == "off" and result.vllm_args == []
    assert not (out / "lmcache.yaml").exists() and not (out / "plan.json").exists()


def test_bad_property_writes_nothing_and_keeps_old_files(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=true\n")
    out = tmp_path / "out"
    configure(mdir, out, {}, host=HOST)
    before = {p.name: p.read_text() for p in out.iterdir()}
    (mdir / "serving.properties").write_text("option.lmcache_auto_config=true\noption.max_model_len=big\n")
    with pytest.raises(PropertiesError, match="max_model_len"):
        configure(mdir, out, {}, host=HOST)
    assert {p.name: p.read_text() for p in out.iterdir()} == before


def test_unwritable_output_dir_is_a_user_error(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=true\n")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigureError, match="--output-dir"):
        configure(mdir, blocker / "out", {}, host=HOST)


def test_missing_model_is_a_user_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "serving.properties").write_text("option.lmcache_auto_config=true\n")
    with pytest.raises(ConfigureError, match="no model"):
        configure(empty, tmp_path / "out", {}, host=HOST)
    assert not (tmp_path / "out").exists()


def test_cpu_kvcache_space_env_parsing() -> None:
    assert cpu_kvcache_space_from_env({}) is None
    assert cpu_kvcache_space_from_env({"VLLM_CPU_KVCACHE_SPACE": " 4 "}) == 4
    with pytest.raises(ConfigureError, match="VLLM_CPU_KVCACHE_SPACE"):
        cpu_kvcache_space_from_env({"VLLM_CPU_KVCACHE_SPACE": "2.5"})


def test_probe_is_used_when_no_host_given(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=true\n")
    calls = []

    def fake_probe():
        calls.append(1)
        return HOST

    configure(mdir, tmp_path / "out", {}, probe=fake_probe)
    assert calls == [1]


def test_configure_fits_lmis_tp_max_to_the_models_heads(tmp_path: Path) -> None:
    mdir = tmp_path / "model"
    mdir.mkdir()
    shutil.copy(FIXTURES / "qwen2.5-7b-instruct" / "config.json", mdir / "config.json")  # 28 heads, 4 KV heads
    (mdir / "serving.properties").write_text("option.lmcache_auto_config=true\n")
    result = configure(mdir, tmp_path / "out", {}, host=host(8, 1024))
    args = json.loads((tmp_path / "out" / "vllm_args.json").read_text())
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert any("'max' is 4, not 8" in m for m in result.messages)

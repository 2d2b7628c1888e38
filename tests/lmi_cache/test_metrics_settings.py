"""Metrics settings checked before vLLM starts: exporter port/address, the multiprocess directory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmi_cache.errors import ConfigError
from lmi_cache.metrics.settings import ExporterSettings, exporter_settings, multiproc_env, reset_multiproc_dir


def test_exporters_off_by_default_and_loopback_by_default() -> None:
    assert exporter_settings({}) is None
    assert exporter_settings({"LMI_CACHE_METRICS_PORT": " 9400 "}) == ExporterSettings(9400, "127.0.0.1")
    assert exporter_settings({"LMI_CACHE_METRICS_PORT": "9400", "LMI_CACHE_METRICS_ADDR": "::"}) == ExporterSettings(
        9400, "::")


@pytest.mark.parametrize("env, says", [
    ({"LMI_CACHE_METRICS_PORT": "abc"}, "LMI_CACHE_METRICS_PORT='abc': must be a TCP port number"),
    ({"LMI_CACHE_METRICS_PORT": "0"}, "LMI_CACHE_METRICS_PORT='0'"),
    ({"LMI_CACHE_METRICS_PORT": "70000"}, "LMI_CACHE_METRICS_PORT='70000'"),
    ({"LMI_CACHE_METRICS_PORT": "1e3"}, "LMI_CACHE_METRICS_PORT='1e3'"),
    ({"LMI_CACHE_METRICS_ADDR": "my host"}, "LMI_CACHE_METRICS_ADDR='my host': not an IP address"),
])
def test_bad_values_are_one_line_naming_the_variable(env: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match="^environment variable " + says) as err:
        exporter_settings(env)
    assert "\n" not in str(err.value)


def test_port_layout_per_replica_and_rank() -> None:
    settings = ExporterSettings(9400, "127.0.0.1")
    # TP x PP = 4: each replica takes 5 ports, its scheduler first.
    assert [settings.port_for(0, 4, r) for r in (None, 0, 3)] == [9400, 9401, 9404]
    assert [settings.port_for(2, 4, r) for r in (None, 0, 3)] == [9410, 9411, 9414]
    with pytest.raises(ConfigError, match="port 65539 "):
        ExporterSettings(65530, "127.0.0.1").port_for(1, 4, 3)


def test_multiproc_env_names_a_directory_per_serving_port_unless_the_user_chose_one(tmp_path: Path) -> None:
    assert multiproc_env({}, tmp_path, 8080) == {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prometheus-8080")}
    assert not (tmp_path / "prometheus-8080").exists()  # a dry run touches nothing
    assert multiproc_env({"PROMETHEUS_MULTIPROC_DIR": "/mine"}, tmp_path, 8080, prepare=True) == {}
    assert multiproc_env({}, tmp_path, 8080, cache_on=False, prepare=True) == {}  # no connector: vLLM as usual
    assert not (tmp_path / "prometheus-8080").exists()
    stale = tmp_path / "prometheus-8080" / "counter_1.db"
    stale.parent.mkdir()
    stale.write_bytes(b"previous run")
    assert multiproc_env({}, tmp_path, 8080, prepare=True) == {"PROMETHEUS_MULTIPROC_DIR": str(stale.parent)}
    assert not stale.exists()
    with pytest.raises(ConfigError, match="LMI_CACHE_METRICS_PORT"):
        multiproc_env({"LMI_CACHE_METRICS_PORT": "abc"}, tmp_path, 8080, cache_on=False)


def test_reset_empties_a_previous_run_and_makes_it_private(tmp_path: Path) -> None:
    target = tmp_path / "prometheus-8080"
    reset_multiproc_dir(str(target))
    assert target.is_dir() and (target.stat().st_mode & 0o777) == 0o700
    (target / "counter_123.db").write_bytes(b"old counts")
    (target / "sub").mkdir()
    reset_multiproc_dir(str(target))
    assert list(target.iterdir()) == []
    reset_multiproc_dir(None)  # the user set PROMETHEUS_MULTIPROC_DIR: serve leaves it alone


def test_reset_refuses_a_symlink(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.db").write_bytes(b"x")
    link = tmp_path / "prometheus-8080"
    os.symlink(elsewhere, link)
    with pytest.raises(ConfigError, match="PROMETHEUS_MULTIPROC_DIR: .*symlink"):
        reset_multiproc_dir(str(link))
    assert (elsewhere / "keep.db").exists()


REPO = Path(__file__).resolve().parents[2]
LLAMA_CONFIG = REPO / "tests" / "fixtures" / "hf_configs" / "llama-3.1-8b-instruct" / "config.json"
CPU_HOST = {"gpus": [], "disks": [], "cpu_count": 8,
            "memory": {"total_bytes": 64 << 30, "available_bytes": 60 << 30, "cgroup_limit_bytes": None,
                       "memlock_limit_bytes": None, "shm_bytes": 8 << 30}}


def run_serve(tmp_path: Path, properties: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``lmi-cache serve --dry-run`` as a process, on a host snapshot, with a model directory of its own."""
    mdir = tmp_path / "model"
    mdir.mkdir(exist_ok=True)
    shutil.copy(LLAMA_CONFIG, mdir / "config.json")
    (mdir / "serving.properties").write_text(properties)
    host = tmp_path / "host.json"
    host.write_text(json.dumps(CPU_HOST))
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("OPTION_", "SM_", "HF_MODEL", "LMI_CACHE_", "PROMETHEUS_"))}
    full_env.update({"LMI_CACHE_RUNTIME_DIR": str(tmp_path / "rt"), "PYTHONPATH": str(REPO), **(env or {})})
    return subprocess.run([sys.executable, "-m", "autoconfig.cli_serve", "serve", "--model-dir", str(mdir),
                           "--host-snapshot", str(host), "--dry-run"],
                          capture_output=True, text=True, env=full_env, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("env, says", [
    ({"LMI_CACHE_METRICS_PORT": "abc"}, "LMI_CACHE_METRICS_PORT='abc': must be a TCP port number"),
    ({"LMI_CACHE_METRICS_ADDR": "0.0.0.0.0"}, "LMI_CACHE_METRICS_ADDR='0.0.0.0.0': not an IP address"),
])
def test_serve_refuses_bad_metrics_settings_before_vllm_starts(tmp_path: Path, env: dict[str, str], says: str) -> None:
    """Before, LMI_CACHE_METRICS_PORT=abc passed serve and then failed inside the vLLM worker."""
    result = run_serve(tmp_path, "option.lmcache_auto_config=true\n", env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmi-cache: error: environment variable {says}")
    assert "Traceback" not in result.stderr and not (tmp_path / "rt" / "prometheus-8080").exists()


def test_serve_points_vllm_at_a_multiprocess_directory(tmp_path: Path) -> None:
    result = run_serve(tmp_path, "option.lmcache_auto_config=true\n")
    assert result.returncode == 0, result.stderr
    assert f"env PROMETHEUS_MULTIPROC_DIR={tmp_path / 'rt' / 'prometheus-8080'}" in result.stdout
    mine = run_serve(tmp_path, "option.lmcache_auto_config=true\n", env={"PROMETHEUS_MULTIPROC_DIR": "/srv/prom"})
    assert "PROMETHEUS_MULTIPROC_DIR" not in mine.stdout  # the user's own directory is left as it is

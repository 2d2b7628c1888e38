"""The lmi-cache CLI: golden outputs for fixed host snapshots, and bad input handling.

Regenerate the golden files after an intended change with
``LMI_CACHE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/autoconfig/test_cli.py``
and review the diff.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from autoconfig.cli import main
from autoconfig.probe.snapshot import HostSnapshot

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "fixtures" / "golden"
HOSTS = "tests/fixtures/hosts"
MODELS = "tests/fixtures/hf_configs"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # relative paths in the goldens
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def _run(args: list[str]):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("LMI_CACHE_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden {path}: run with LMI_CACHE_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text()


GOLDEN_CASES = [
    ("plan_qwen72b_tp8_a100x8", ["--model", f"{MODELS}/qwen2.5-72b-instruct", "--tp", "8",
                                 "--host-snapshot", f"{HOSTS}/a100x8_nvme_cgroup.json"]),
    ("plan_llama8b_a10g_memlock", ["--model", f"{MODELS}/llama-3.1-8b-instruct", "--max-model-len", "16384",
                                   "--host-snapshot", f"{HOSTS}/a10g_container_memlock.json"]),
    ("plan_qwen05b_cpu_only", ["--model", f"{MODELS}/qwen2.5-0.5b-instruct", "--max-model-len", "8192",
                               "--host-snapshot", f"{HOSTS}/cpu_only_rotational.json"]),
    ("plan_llama70b_tp4_dp2_fp8", ["--model", f"{MODELS}/llama-3.3-70b-instruct", "--tp", "4", "--dp", "2",
                                   "--kv-cache-dtype", "fp8", "--engine", "lmcache",
                                   "--host-snapshot", f"{HOSTS}/a100x8_nvme_cgroup.json"]),
]


@pytest.mark.parametrize(("name", "args"), GOLDEN_CASES, ids=[c[0] for c in GOLDEN_CASES])
def test_plan_json_golden(name: str, args: list[str]) -> None:
    result = _run(["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["vllm_args"][0] == "--kv-transfer-config"
    _golden(f"{name}.json", result.stdout)


@pytest.mark.parametrize(("name", "args"), GOLDEN_CASES[:2], ids=[c[0] for c in GOLDEN_CASES[:2]])
def test_plan_human_golden(name: str, args: list[str]) -> None:
    result = _run(["plan", *args])
    assert result.exit_code == 0, result.output
    assert "LMI formula" in result.stdout and "How each number was computed" in result.stdout
    _golden(f"{name}.txt", result.stdout)


def test_plan_instance_type_what_if() -> None:
    result = _run(["plan", "--model", f"{MODELS}/qwen2.5-72b-instruct", "--tp", "8",
                   "--instance-type", "ml.p4de.24xlarge", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["parallel"]["ranks_per_host"] == 8 and data["gpu"]["backend"] == "cuda"
    assert data["tiers"]["cpu"]["enabled"] and data["lmi_reference"]["cpu_gib_per_rank"] > 0


def _assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmi-cache: error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0]


def test_missing_model_is_one_line_exit_2() -> None:
    _assert_one_line_error(_run(["plan", "--model", "/no/such/model", "--host-snapshot", f"{HOSTS}/cpu_only_rotational.json"]),
                           "/no/such/model")


def test_snapshot_missing_field_names_file_and_key() -> None:
    _assert_one_line_error(_run(["plan", "--model", f"{MODELS}/qwen3-8b", "--host-snapshot", f"{HOSTS}/bad_missing_available.json"]),
                           "bad_missing_available.json", "memory.available_bytes")


def test_snapshot_not_json(tmp_path: Path) -> None:
    bad = tmp_path / "host.json"
    bad.write_text("{not json")
    _assert_one_line_error(_run(["plan", "--model", f"{MODELS}/qwen3-8b", "--host-snapshot", str(bad)]), str(bad))


def test_tp_beyond_gpus_is_one_line_exit_2() -> None:
    _assert_one_line_error(_run(["plan", "--model", f"{MODELS}/qwen3-8b", "--tp", "16",
                                 "--host-snapshot", f"{HOSTS}/a100x8_nvme_cgroup.json"]), "--tp=16", "needs 16 GPUs")


def test_hybrid_model_for_upstream_lmcache_is_refused() -> None:
    result = _run(["plan", "--model", f"{MODELS}/jamba-v0.1", "--host-snapshot", f"{HOSTS}/a100x8_nvme_cgroup.json",
                   "--engine", "lmcache"])
    _assert_one_line_error(result)


def test_host_and_instance_type_together_is_a_usage_error() -> None:
    result = _run(["plan", "--model", f"{MODELS}/qwen3-8b", "--host-snapshot", f"{HOSTS}/cpu_only_rotational.json",
                   "--instance-type", "ml.g5.xlarge"])
    assert result.exit_code == 2 and "not both" in result.stderr


def _model_dir(tmp_path: Path, properties: str) -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir()
    (mdir / "config.json").write_text((REPO / MODELS / "qwen2.5-0.5b-instruct" / "config.json").read_text())
    (mdir / "serving.properties").write_text(properties)
    return mdir


def test_configure_bad_property_writes_nothing(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=maybe\n")
    out = tmp_path / "out"
    _assert_one_line_error(_run(["configure", "--model-dir", str(mdir), "--output-dir", str(out)]),
                           "serving.properties", "option.lmcache_auto_config")
    assert not out.exists()


def test_configure_on_this_machine_writes_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=true\noption.max_model_len=4096\n")
    out = tmp_path / "out"
    result = _run(["configure", "--model-dir", str(mdir), "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out / 'lmcache.yaml'}" in result.stdout
    assert json.loads((out / "vllm_args.json").read_text())[0] == "--kv-transfer-config"


def test_validate_exit_codes(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("chunk_size: 256\nmax_local_cpu_size: 20\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: 256\nmax_local_cpu_sizee: 20\n")
    common = ["--model", f"{MODELS}/llama-3.1-8b-instruct", "--host-snapshot", f"{HOSTS}/a100x8_nvme_cgroup.json"]
    ok = _run(["validate", str(good), *common])
    assert ok.exit_code == 0 and "0 error(s)" in ok.stdout
    ko = _run(["validate", str(bad), *common])
    assert ko.exit_code == 1 and "did you mean 'max_local_cpu_size'" in ko.stdout
    _assert_one_line_error(_run(["validate", str(tmp_path / "missing.yaml"), *common]), "missing.yaml")


def test_probe_json_runs_for_real_and_round_trips() -> None:
    result = _run(["probe", "--json"])
    assert result.exit_code == 0, result.output
    snapshot = HostSnapshot.from_dict(json.loads(result.stdout), "probe")
    assert snapshot.memory.total_bytes > 0
    human = _run(["probe"])
    assert human.exit_code == 0 and "Memory:" in human.stdout


def test_every_command_is_registered() -> None:
    assert {"probe", "plan", "configure", "validate", "serve", "sagemaker", "bench"} <= set(main.commands)


def test_real_process_prints_one_line_without_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "autoconfig.cli", "plan", "--model", "/no/such"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("lmi-cache: error: ")


def test_plan_tier_overrides_are_honoured_and_checked(tmp_path: Path) -> None:
    base = ["plan", "--model", f"{MODELS}/qwen2.5-72b-instruct", "--tp", "8", "--instance-type", "ml.p4de.24xlarge"]
    result = _run(base + ["--cpu-size-gib", "50", "--disk-size-gib", "0", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["tiers"]["cpu"]["bytes_per_rank"] == 50 << 30
    assert data["tiers"]["disk"]["enabled"] is False
    assert data["lmcache_config"]["max_local_cpu_size"] == 50
    _assert_one_line_error(_run(base + ["--cpu-size-gib", "100000"]), "--cpu-size-gib=100000.0 GiB per rank does not fit")  # the flag as typed

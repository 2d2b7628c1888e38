"""``autoconfig.serve.prepare_launch``: settings -> the vLLM command and environment (no exec)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from autoconfig.probe.snapshot import DiskInfo, GpuInfo, HostSnapshot, MemoryInfo
from autoconfig.serve.launch import ServeLaunch, prepare_launch
from lmi_cache.errors import UserError

GIB = 1 << 30
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"


def make_host(num_gpus: int, ram_gib: int = 256, nvme_mount: str | None = None) -> HostSnapshot:
    gpus = [GpuInfo(i, "NVIDIA L40S", 48 * GIB, 47 * GIB) for i in range(num_gpus)]
    disks = []
    if nvme_mount is not None:
        disks.append(DiskInfo(nvme_mount, "/dev/nvme1n1", "xfs", 3500 * GIB, 3400 * GIB, False, True, True))
    return HostSnapshot(gpus=gpus, memory=MemoryInfo(ram_gib * GIB, ram_gib * GIB, None, None, 64 * GIB),
                        disks=disks, cpu_count=48)


def model_dir(tmp_path: Path, properties: str | None, model: str | None = "llama-3.1-8b-instruct") -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir(exist_ok=True)
    if model is not None:
        shutil.copy(FIXTURES / model / "config.json", mdir / "config.json")
    if properties is not None:
        (mdir / "serving.properties").write_text(properties)
    return mdir


def launch(tmp_path: Path, properties: str | None, host: HostSnapshot | None = None,
           env: dict[str, str] | None = None, **kw: Any) -> ServeLaunch:
    mdir = kw.pop("mdir", None) or model_dir(tmp_path, properties, **kw)
    return prepare_launch(mdir, env or {}, host=host or make_host(1), output_dir=tmp_path / "runtime",
                          python="/usr/bin/python3")


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def test_auto_config_writes_yaml_and_loads_the_connector(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.lmcache_auto_config=true\noption.max_rolling_batch_size=32\n")
    assert result.argv[:3] == ["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag_value(result.argv, "--host") == "0.0.0.0"
    assert flag_value(result.argv, "--port") == "8080"
    assert flag_value(result.argv, "--model") == str(tmp_path / "model")
    assert flag_value(result.argv, "--max-num-seqs") == "32"
    kv = json.loads(flag_value(result.argv, "--kv-transfer-config"))
    assert kv["kv_connector"] == "LmiCacheConnector"
    yaml_path = Path(result.env_set["LMCACHE_CONFIG_FILE"])
    assert yaml_path == tmp_path / "runtime" / "lmcache.yaml" and yaml_path.is_file()
    assert result.env["LMCACHE_CONFIG_FILE"] == str(yaml_path)
    assert result.mode == "auto"
    assert "VLLM_CPU_KVCACHE_SPACE" not in result.env_set  # a GPU host
    assert any(line.startswith("cache: auto-configured") for line in result.summary)


def test_no_cache_option_serves_without_the_connector(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.max_model_len=4096\n")
    assert "--kv-transfer-config" not in result.argv
    assert "LMCACHE_CONFIG_FILE" not in result.env_set
    assert flag_value(result.argv, "--max-model-len") == "4096"
    assert result.mode == "off"
    assert any("cache: off" in line for line in result.summary)


def test_port_comes_from_sagemaker_bind_to_port(tmp_path: Path) -> None:
    result = launch(tmp_path, "", env={"SAGEMAKER_BIND_TO_PORT": "9001"})
    assert flag_value(result.argv, "--port") == "9001"
    with pytest.raises(UserError, match="SAGEMAKER_BIND_TO_PORT"):
        launch(tmp_path, "", env={"SAGEMAKER_BIND_TO_PORT": "http"})


def test_env_only_settings_with_sm_num_gpus_and_hf_model_id(tmp_path: Path) -> None:
    weights = model_dir(tmp_path, None)
    empty = tmp_path / "empty-model-dir"
    empty.mkdir()
    env = {"SM_NUM_GPUS": "4", "HF_MODEL_ID": str(weights), "OPTION_LMCACHE_AUTO_CONFIG": "true",
           "OPTION_ENABLE_PREFIX_CACHING": "false"}
    result = launch(tmp_path, None, host=make_host(4), env=env, mdir=empty)
    assert flag_value(result.argv, "--tensor-parallel-size") == "4"
    assert flag_value(result.argv, "--model") == str(weights)
    assert "--no-enable-prefix-caching" in result.argv
    assert result.mode == "auto"


def test_serving_properties_wins_over_env(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.tensor_parallel_degree=2\noption.max_rolling_batch_size=8\n",
                    host=make_host(4), env={"OPTION_TENSOR_PARALLEL_DEGREE": "4", "OPTION_MAX_ROLLING_BATCH_SIZE": "99"})
    assert flag_value(result.argv, "--tensor-parallel-size") == "2"
    assert flag_value(result.argv, "--max-num-seqs") == "8"


def test_tp_max_means_every_gpu(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.tensor_parallel_degree=max\noption.lmcache_auto_config=true\n",
                    host=make_host(8))
    assert flag_value(result.argv, "--tensor-parallel-size") == "8"


def test_passthrough_json_and_ignored_lmi_options(tmp_path: Path) -> None:
    props = ('option.speculative_config={"method": "ngram", "num_speculative_tokens": 2}\n'
             "option.rolling_batch=vllm\noption.entryPoint=djl_python.huggingface\n")
    result = launch(tmp_path, props)
    assert json.loads(flag_value(result.argv, "--speculative-config"))["num_speculative_tokens"] == 2
    assert "--rolling-batch" not in result.argv
    assert sum("ignored" in line for line in result.summary) == 2


def test_cpu_only_host_gets_a_kv_space_unless_the_user_set_one(tmp_path: Path) -> None:
    result = launch(tmp_path, "", host=make_host(0, ram_gib=24))
    assert 1 <= int(result.env_set["VLLM_CPU_KVCACHE_SPACE"]) <= 6
    kept = launch(tmp_path, "", host=make_host(0), env={"VLLM_CPU_KVCACHE_SPACE": "3"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in kept.env_set
    assert kept.env["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_user_yaml_is_validated_then_used(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\n")
    (mdir / "lmcache.yaml").write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 20\n")
    result = launch(tmp_path, None, mdir=mdir)
    assert result.env_set["LMCACHE_CONFIG_FILE"] == str(mdir / "lmcache.yaml")
    assert json.loads(flag_value(result.argv, "--kv-transfer-config"))["kv_connector"] == "LmiCacheConnector"
    assert result.mode == "file"


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("chunk_size: 256\nmax_local_cpu_sise: 20\n", "did you mean 'max_local_cpu_size'"),
        ("max_local_cpu_size: 4000\n", "max_local_cpu_size"),
    ],
)
def test_user_yaml_errors_fail_before_start(tmp_path: Path, yaml_text: str, expected: str) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\n")
    (mdir / "lmcache.yaml").write_text(yaml_text)
    with pytest.raises(UserError, match=expected) as info:
        launch(tmp_path, None, mdir=mdir)
    assert "lmcache_config_file" in str(info.value)
    assert not (tmp_path / "runtime" / "vllm_args.json").exists(), "nothing may be written on error"


@pytest.mark.parametrize(
    ("properties", "num_gpus", "expected"),
    [
        ("option.lmcache_auto_config=true\noption.lmcache_config_file=/x.yaml\n", 1, "choose one"),
        ("option.lmcache_auto_config=yes\n", 1, "must be true or false"),
        ("option.tensor_parallel_degree=8\n", 4, "needs 8 GPUs but this host has 4"),
        ("option.tensor_parallel_degree=8\noption.lmcache_auto_config=true\n", 4, "this host has 4"),
        ("option.max_rolling_batch_sise=8\n", 1, "did you mean option.max_rolling_batch_size"),
        ("option.lmcache_auto_config=true\noption.kv_transfer_config={}\n", 1, "conflicts with the LMCache connector"),
        ("option.lmcache_auto_config=true\noption.kv_offloading_size=8\n", 1, "takes one KV connector"),
    ],
)
def test_bad_settings_fail_with_one_line(tmp_path: Path, properties: str, num_gpus: int, expected: str) -> None:
    with pytest.raises(UserError, match=expected) as info:
        launch(tmp_path, properties, host=make_host(num_gpus))
    assert "\n" not in str(info.value)


def test_no_model_anywhere_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no model"):
        launch(tmp_path, "option.lmcache_auto_config=false\n", model=None)


def test_kv_transfer_config_passes_through_when_the_cache_is_off(tmp_path: Path) -> None:
    result = launch(tmp_path, 'option.kv_transfer_config={"kv_connector": "Mine", "kv_role": "kv_both"}\n')
    assert json.loads(flag_value(result.argv, "--kv-transfer-config"))["kv_connector"] == "Mine"


def test_secrets_are_masked_in_the_summary_and_printed_command(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.hf_token=hf_secret123\nengine=Python\n")
    assert "--hf-token" not in result.argv and "hf_secret123" not in " ".join(result.argv)
    assert result.env["HF_TOKEN"] == "hf_secret123"  # vLLM gets it through its environment
    printed = "\n".join(result.summary) + result.command_line()
    assert "hf_secret123" not in printed
    assert "option hf_token = ***" in printed and "env HF_TOKEN=***" in printed
    assert any("engine=Python" in line and "ignored" in line for line in result.summary)


@pytest.mark.parametrize("dry_run", [True, False])
def test_only_a_real_start_cleans_the_sessions_folder(tmp_path: Path, dry_run: bool) -> None:
    folder = tmp_path / "sessions"
    (folder / "crashed").mkdir(parents=True)
    (folder / "crashed" / ".expiration_ts").write_text("")  # a crash mid-write: AWS's library cannot start on it
    mdir = model_dir(tmp_path, f"option.sessions_path={folder}\n")
    prepare_launch(mdir, {}, host=make_host(1), output_dir=tmp_path / "runtime", python="/usr/bin/python3",
                   dry_run=dry_run)
    assert (folder / "crashed").exists() == dry_run

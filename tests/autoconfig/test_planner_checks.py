"""Plans only promise what will start: TP/heads, kernel-view and comma paths, bounded overrides, unsafe dirs."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from plan_helpers import GIB, LLAMA8B, disk, host

from autoconfig.cli import main
from autoconfig.plan.types import PlanError, PlanModel
from autoconfig.plan.planner import plan_tiers
from autoconfig.plan.settings import ServingSettings, TierOverrides
from lmi_cache.kv_layout import KvLayout

REPO = Path(__file__).resolve().parents[2]
HOST8 = host(8, 1000, disks=[disk("/", free_gib=500, fs_type="ext4"), disk("/nvme", free_gib=3000),
                            disk("/proc", free_gib=0, fs_type="proc", nvme=False, rotational=None)])
LLAMA_HEADS = replace(LLAMA8B, num_attention_heads=32)  # 32 query heads, 8 KV heads


def _plan(model: PlanModel = LLAMA_HEADS, **settings: object):
    return plan_tiers(HOST8, model, ServingSettings(**settings))  # type: ignore[arg-type]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_dividing_the_heads_plans(tp: int) -> None:
    assert _plan(tp=tp).tp == tp


def test_tp_that_does_not_divide_the_heads_is_refused_with_choices() -> None:
    with pytest.raises(PlanError) as info:
        _plan(tp=3)
    message = str(info.value)
    assert "tensor_parallel_degree=3" in message and "32 attention heads" in message and "8" in message


def test_tp_that_cannot_split_the_kv_heads_is_refused() -> None:
    odd = PlanModel(KvLayout(32, 8, 128, "bfloat16"), 16 * GIB, 8192, "odd", num_attention_heads=40)
    with pytest.raises(PlanError, match="8 KV heads"):
        plan_tiers(host(20, 1000, disks=[disk("/nvme", free_gib=3000)]), odd, ServingSettings(tp=20))


def test_pp_larger_than_the_layers_is_refused() -> None:
    tiny = PlanModel(KvLayout(2, 1, 64, "bfloat16"), GIB, 4096, "tiny", num_attention_heads=4)
    with pytest.raises(PlanError, match="pipeline_parallel_degree=4"):
        plan_tiers(host(8, 1000, disks=[disk("/nvme", free_gib=3000)]), tiny, ServingSettings(pp=4))


def test_real_config_carries_its_head_count() -> None:
    from autoconfig.model.source import load_model_info

    info = load_model_info(str(REPO / "tests/fixtures/hf_configs/qwen2.5-7b-instruct"))  # 28 heads, 4 KV heads
    with pytest.raises(PlanError, match="28 attention heads"):
        plan_tiers(HOST8, info, ServingSettings(tp=8))
    assert plan_tiers(HOST8, info, ServingSettings(tp=4)).tp == 4


@pytest.mark.parametrize(
    "path, needle",
    [
        ("/proc/lmcache", "can never be created"),
        ("file:///sys/kernel/lmcache/", "can never be created"),
        ("/dev/shm-not/lmcache", "can never be created"),
        ("relative/kv", "absolute"),
        ("", "empty"),
        ("/mnt/a,b/kv", "comma"),
        ("/mnt/a\nb", "control character"),
    ],
)
def test_disk_paths_that_can_never_work_are_refused(path: str, needle: str) -> None:
    with pytest.raises(PlanError) as info:
        _plan(overrides=TierOverrides(disk_path=path, disk_size_gib=10))
    assert "lmcache_local_disk" in str(info.value) and needle in str(info.value)
    assert "\n" not in str(info.value)


def test_dev_shm_is_a_usable_if_unwise_disk_path() -> None:
    snap = host(1, 200, disks=[disk("/dev/shm", free_gib=100, fs_type="tmpfs", is_tmpfs=True), disk("/data", free_gib=10)])
    plan = plan_tiers(snap, LLAMA_HEADS, ServingSettings(overrides=TierOverrides(disk_path="/dev/shm/kv", disk_size_gib=1)))
    assert plan.disk.path == "/dev/shm/kv" and any("tmpfs" in w for w in plan.warnings)


def test_auto_disk_never_picks_a_mount_with_a_comma() -> None:
    snap = host(1, 200, disks=[disk("/mnt/a,b", free_gib=5000), disk("/data", free_gib=1000)])
    plan = plan_tiers(snap, LLAMA_HEADS, ServingSettings())
    assert plan.disk.enabled and plan.disk.path is not None and "," not in plan.disk.path


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (TierOverrides(cpu_size_gib=float("nan")), "lmcache_max_local_cpu_size"),
        (TierOverrides(cpu_size_gib=float("inf")), "lmcache_max_local_cpu_size"),
        (TierOverrides(cpu_size_gib=1e308), "lmcache_max_local_cpu_size"),
        (TierOverrides(disk_size_gib=-1.0), "lmcache_max_local_disk_size"),
        (TierOverrides(chunk_size=10**12), "lmcache_chunk_size"),
    ],
)
def test_overrides_are_finite_and_bounded(overrides: TierOverrides, needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        _plan(overrides=overrides)


@pytest.mark.parametrize("settings", [{"tp": 10**9}, {"dp": 0}, {"gpu_memory_utilization": float("nan")},
                                      {"max_model_len": 10**15}])
def test_settings_are_bounded(settings: dict[str, object]) -> None:
    with pytest.raises(PlanError):
        _plan(**settings)


# ---------------------------------------------------------------- the CLI, live host


def _cli(args: list[str]):
    result = CliRunner().invoke(main, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e308", "-1", "abc"])
def test_size_flags_refuse_non_finite_values(value: str) -> None:
    result = _cli(["plan", "--model", str(REPO / "tests/fixtures/hf_configs/qwen2.5-0.5b-instruct"),
                   "--host-snapshot", str(REPO / "tests/fixtures/hosts/a100x8_nvme_cgroup.json"), "--cpu-size-gib", value])
    assert result.exit_code == 2 and "--cpu-size-gib" in result.output and "Traceback" not in result.output


def test_plan_refuses_a_disk_path_under_a_file(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    result = _cli(["plan", "--model", str(REPO / "tests/fixtures/hf_configs/qwen2.5-0.5b-instruct"),
                   "--max-model-len", "4096", "--disk-path", str(a_file / "kv"), "--disk-size-gib", "1"])
    assert result.exit_code == 2 and "can never be created" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root (CI runs as root)")
def test_plan_and_validate_refuse_another_users_directory(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 12345, 12345)
    model = str(REPO / "tests/fixtures/hf_configs/qwen2.5-0.5b-instruct")
    result = _cli(["plan", "--model", model, "--max-model-len", "4096", "--disk-path", str(theirs),
                   "--disk-size-gib", "1"])
    assert result.exit_code == 2 and "owned by uid 12345" in result.output
    config = tmp_path / "lmcache.yaml"
    config.write_text(f"local_disk: file://{theirs}/\nmax_local_disk_size: 1\nmax_local_cpu_size: 1\n")
    result = _cli(["validate", str(config), "--model", model, "--max-model-len", "4096"])
    assert result.exit_code == 1 and "ERROR   local_disk" in result.output and "owned by uid 12345" in result.output


def test_validate_takes_max_model_len(tmp_path: Path) -> None:
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\nmax_local_cpu_size: 1\n")
    args = ["validate", str(config), "--model", str(REPO / "tests/fixtures/hf_configs/qwen2.5-0.5b-instruct"),
            "--host-snapshot", str(REPO / "tests/fixtures/hosts/a100x8_nvme_cgroup.json")]
    too_long = _cli(args + ["--max-model-len", "100000000"])
    # checked against the length vLLM will be given: no KV cache holds one such sequence
    assert too_long.exit_code == 1 and "max_model_len=100000000: the GPU KV cache holds" in too_long.output
    assert _cli(args).exit_code == 0
    refused = _cli(args + ["--max-model-len", "0"])
    assert refused.exit_code == 2 and "--max-model-len" in refused.output


# ---------------------------------------------------------------- the serving.properties path (configure)


def _model_dir(tmp_path: Path, properties: str) -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir()
    (mdir / "config.json").write_text((REPO / "tests/fixtures/hf_configs/llama-3.1-8b-instruct/config.json").read_text())
    (mdir / "serving.properties").write_text(properties)
    return mdir


@pytest.mark.parametrize(
    "line, needle",
    [
        ("option.lmcache_local_disk=/nvme/a,b", "comma"),
        ("option.lmcache_local_disk=file:///proc/lmcache/", "can never be created"),
        ("option.lmcache_max_local_cpu_size=1e308", "lmcache_max_local_cpu_size"),
        ("option.tensor_parallel_degree=3", "32 attention heads"),
    ],
)
def test_configure_refuses_before_writing(tmp_path: Path, line: str, needle: str) -> None:
    from autoconfig.serve.configure import configure

    mdir = _model_dir(tmp_path, f"option.lmcache_auto_config=true\n{line}\n")
    with pytest.raises(PlanError, match=needle):
        configure(mdir, tmp_path / "out", {}, host=host(8, 400, disks=[disk("/nvme", free_gib=2000)]))
    assert not (tmp_path / "out").exists()


def test_configure_lists_lmcache_env_overrides(tmp_path: Path) -> None:
    from autoconfig.serve.configure import configure

    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=true\n")
    env = {"LMCACHE_CHUNK_SIZE": "512", "LMCACHE_REMOTE_URL": "redis://u:secret@h:6379", "LMCACHE_LOG_LEVEL": "DEBUG"}
    result = configure(mdir, tmp_path / "out", env, host=host(1, 400, disks=[disk("/nvme", free_gib=2000)]))
    lines = [m for m in result.messages if "the LMCache YAML" in m]
    assert lines == ["warning: LMCACHE_CHUNK_SIZE, LMCACHE_REMOTE_URL override the LMCache YAML (the environment "
                     "wins over the file, as in LMCache)"]  # once, every override named
    assert not any("secret" in m for m in result.messages)


@pytest.mark.parametrize(
    "line, needle",
    [
        ("option.cpu_offload_gb=inf", "expected a finite number"),
        ("option.cpu_offload_gb=nan", "expected a finite number"),
        ("option.speculative_config=" + "[" * 3000 + "]" * 3000, "nested too deeply"),
        ("option.kv_transfer_config=" + '{"a": ' + "9" * 5000 + "}", "a number too long"),
    ],
)
def test_serve_refuses_non_finite_and_unparseable_json_options(tmp_path: Path, line: str, needle: str) -> None:
    mdir = _model_dir(tmp_path, line + "\n")
    env = {"LMI_CACHE_RUNTIME_DIR": str(tmp_path / "runtime")}
    result = CliRunner().invoke(main, ["serve", "--dry-run", "--model-dir", str(mdir),
                                       "--host-snapshot", str(REPO / "tests/fixtures/hosts/a100x8_nvme_cgroup.json")], env=env)
    assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output

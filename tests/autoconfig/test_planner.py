"""Unit tests for each planner rule (autoconfig.plan.planner.plan_tiers)."""
from __future__ import annotations

import math

import pytest
from plan_helpers import GIB, LLAMA8B, disk, gpus, host, memory

from autoconfig.probe.snapshot import HostSnapshot
from autoconfig.plan.types import PlanError, PlanModel
from autoconfig.plan.planner import gib_floor_bytes, lmi_reference, plan_tiers
from autoconfig.plan.settings import ServingSettings, TierOverrides
from lmi_cache.kv_layout import KvLayout

S = ServingSettings


def test_gpu_capacity_is_budget_minus_weights_and_reserve() -> None:
    # 80 GiB x 0.9 = 72 GiB - 16 GiB weights - 4 GiB reserve (5% of 80) = 52 GiB / 128 KiB per token.
    plan = plan_tiers(host(1), LLAMA8B, S())
    assert plan.gpu.backend == "cuda"
    assert plan.gpu.kv_bytes_per_rank == 52 * GIB
    assert plan.gpu.kv_capacity_tokens == 52 * 8192
    assert any(line.startswith("gpu.kv_capacity_tokens") for line in plan.explanation)


def test_gpu_weights_split_over_tp_and_per_rank_bytes() -> None:
    plan = plan_tiers(host(8), LLAMA8B, S(tp=8))
    assert plan.kv_bytes_per_token == 131072
    assert plan.kv_bytes_per_token_per_rank == 16384  # one KV head per rank
    # 72 - 2 (16/8) - 4 = 66 GiB per rank
    assert plan.gpu.kv_capacity_tokens == 66 * GIB // 16384


def test_tp_larger_than_gpus_is_an_error_naming_the_option() -> None:
    with pytest.raises(PlanError, match="tensor_parallel_degree=4.*multi-node"):
        plan_tiers(host(2), LLAMA8B, S(tp=4))


def test_weights_that_do_not_fit_the_gpu_are_an_error() -> None:
    big = PlanModel(LLAMA8B.layout, 140 * GIB, 8192, "big")
    with pytest.raises(PlanError, match="raise tensor_parallel_degree"):
        plan_tiers(host(1), big, S())


def test_dp_beyond_gpus_is_refused() -> None:
    with pytest.raises(PlanError, match="data_parallel_degree=4 replicas .* need 8 GPUs .* has 4: lower "
                                        "data_parallel_degree to 2"):
        plan_tiers(host(4), LLAMA8B, S(tp=2, dp=4))
    assert plan_tiers(host(4), LLAMA8B, S(tp=2, dp=2)).ranks_per_host == 4


def test_cpu_backend_sets_kvcache_space_for_one_sequence() -> None:
    cpu_host = HostSnapshot(gpus=[], memory=memory(200), disks=[])
    plan = plan_tiers(cpu_host, LLAMA8B, S(max_model_len=32768))
    # 32768 tokens x 128 KiB = 4 GiB exactly
    assert plan.gpu.backend == "cpu"
    assert plan.gpu.cpu_kvcache_space_gib == 4
    assert plan.env == {"VLLM_CPU_KVCACHE_SPACE": "4"}
    assert plan.gpu.kv_capacity_tokens == 32768
    assert plan.gpu.block_size == 128


def test_cpu_backend_honours_user_space_and_refuses_one_too_small() -> None:
    cpu_host = HostSnapshot(gpus=[], memory=memory(200), disks=[])
    plan = plan_tiers(cpu_host, LLAMA8B, S(max_model_len=16384), cpu_kvcache_space_gib=2)
    assert plan.gpu.kv_capacity_tokens == 16384
    # 2 GiB holds 16,384 tokens of 128 KiB: a 32K sequence does not fit, and the message says what does.
    with pytest.raises(PlanError, match="VLLM_CPU_KVCACHE_SPACE=2 holds 16,384 tokens.*max_model_len to 16384 or "
                                        "less, or VLLM_CPU_KVCACHE_SPACE to 4"):
        plan_tiers(cpu_host, LLAMA8B, S(max_model_len=32768), cpu_kvcache_space_gib=2)


def test_cpu_backend_counts_weights_and_kv_space_in_ram_needs() -> None:
    cpu_host = HostSnapshot(gpus=[], memory=memory(100), disks=[])
    plan = plan_tiers(cpu_host, LLAMA8B, S(max_model_len=8192))
    # usable 100 - (2 frontend + 1 overhead + 16 weights + 1 KV space) - 10 margin = 70 GiB
    assert plan.cpu.bytes_per_rank == 70 * GIB


def test_cpu_tier_uses_cgroup_headroom_not_host_ram() -> None:
    plan = plan_tiers(host(1, available_gib=500, cgroup_gib=100, usage_gib=10), LLAMA8B, S())
    # usable = min(500, 100 - 10) = 90; needs 2 + 3; margin 9 -> 76 GiB
    assert plan.cpu.enabled
    assert plan.cpu.bytes_per_rank == 76 * GIB
    assert plan.lmcache_config["max_local_cpu_size"] == 76.0


def test_cpu_tier_divided_by_all_ranks_on_host() -> None:
    plan = plan_tiers(host(8, available_gib=1000), LLAMA8B, S(tp=2, dp=4))
    # 1000 - (2 + 8 x 3) - 100 = 874 / 8 ranks = 109.25
    assert plan.cpu.bytes_per_rank == gib_floor_bytes(874 * GIB // 8)
    assert plan.lmcache_config["max_local_cpu_size"] == 109.25


def test_cpu_tier_off_when_not_larger_than_gpu_cache() -> None:
    plan = plan_tiers(host(1, available_gib=50), LLAMA8B, S())
    assert not plan.cpu.enabled
    assert plan.cpu.bytes_per_rank == 0 and plan.cpu.capacity_tokens == 0
    assert plan.lmcache_config["local_cpu"] is False
    assert any(w.startswith("CPU tier off") for w in plan.warnings)


def test_memlock_caps_cpu_tier_and_warns() -> None:
    plan = plan_tiers(host(1, available_gib=500, memlock_gib=64), LLAMA8B, S())
    assert plan.cpu.bytes_per_rank <= 64 * GIB
    assert any("memlock" in w for w in plan.warnings)


def test_tiny_memlock_warns_without_capping() -> None:
    plan = plan_tiers(host(1, available_gib=500, memlock_gib=64 / 1024 / 1024), LLAMA8B, S())
    assert plan.cpu.enabled and plan.cpu.bytes_per_rank > 64 * GIB
    assert any("memlock" in w and "pageable" in w for w in plan.warnings)


def test_memlock_unlimited_does_not_cap() -> None:
    plan = plan_tiers(host(1, available_gib=500), LLAMA8B, S())
    assert plan.cpu.bytes_per_rank > 64 * GIB
    assert not any("memlock" in w for w in plan.warnings)


def test_cpu_override_zero_disables_and_too_big_is_an_error() -> None:
    off = plan_tiers(host(1, 500), LLAMA8B, S(overrides=TierOverrides(cpu_size_gib=0)))
    assert not off.cpu.enabled
    with pytest.raises(PlanError, match="lmcache_max_local_cpu_size=5000"):
        plan_tiers(host(1, 500), LLAMA8B, S(overrides=TierOverrides(cpu_size_gib=5000)))
    ok = plan_tiers(host(1, 500), LLAMA8B, S(overrides=TierOverrides(cpu_size_gib=100.555)))
    assert ok.cpu.enabled and ok.lmcache_config["max_local_cpu_size"] == 100.55


def test_disk_prefers_nvme_then_ssd_and_never_rotational_tmpfs_network() -> None:
    disks = [
        disk("/", free_gib=5000, nvme=False, rotational=None, fs_type="overlay", is_overlay=True),
        disk("/hdd", free_gib=9000, nvme=False, rotational=True),
        disk("/dev/shm", free_gib=9000, fs_type="tmpfs", is_tmpfs=True),
        disk("/nfs", free_gib=9000, fs_type="nfs4", is_network=True),
        disk("/ssd", free_gib=3000, nvme=False, rotational=False),
        disk("/nvme", free_gib=2000),
    ]
    plan = plan_tiers(host(1, 50, disks=disks), LLAMA8B, S())
    assert plan.disk.enabled and plan.disk.mount == "/nvme" and plan.disk.path == "/nvme/lmcache"
    plan = plan_tiers(host(1, 50, disks=disks[:5]), LLAMA8B, S())
    assert plan.disk.mount == "/ssd"
    plan = plan_tiers(host(1, 50, disks=disks[:4]), LLAMA8B, S())
    assert plan.disk.mount == "/" and plan.disk.path == "/tmp/lmcache"
    assert any("overlay" in w for w in plan.warnings)
    plan = plan_tiers(host(1, 50, disks=disks[1:4]), LLAMA8B, S())
    assert not plan.disk.enabled and any(w.startswith("disk tier off") for w in plan.warnings)


def test_disk_on_root_uses_tmp_unless_tmp_is_a_separate_mount() -> None:
    disks = [disk("/", free_gib=500), disk("/tmp", free_gib=1, fs_type="tmpfs", is_tmpfs=True)]
    plan = plan_tiers(host(1, 50, disks=disks), LLAMA8B, S())
    assert plan.disk.path == "/var/tmp/lmcache"


def test_disk_size_is_free_minus_reserve_over_ranks() -> None:
    disks = [disk("/nvme", free_gib=1000, total_gib=2000)]
    plan = plan_tiers(host(4, 50, disks=disks), LLAMA8B, S(tp=4))
    # reserve max(5, 200) -> 800 GiB / 4 ranks = 200 GiB
    assert plan.disk.bytes_per_rank == 200 * GIB
    assert plan.lmcache_config["max_local_disk_size"] == 200.0
    assert plan.lmcache_config["local_disk"] == "file:///nvme/lmcache/"
    assert plan.disk.use_odirect is True


def test_disk_odirect_follows_probe() -> None:
    plan = plan_tiers(host(1, 50, disks=[disk("/nvme", free_gib=1000, odirect=None)]), LLAMA8B, S())
    assert plan.disk.enabled and plan.disk.use_odirect is False
    assert plan.lmcache_config["extra_config"] == {"use_odirect": False}


def test_disk_off_when_it_adds_nothing_beyond_cpu() -> None:
    plan = plan_tiers(host(1, 2000, disks=[disk("/nvme", free_gib=20, total_gib=20)]), LLAMA8B, S())
    assert plan.cpu.enabled and not plan.disk.enabled
    assert "local_disk" not in plan.lmcache_config and plan.lmcache_config["max_local_disk_size"] == 0.0


def test_disk_overrides_are_checked() -> None:
    disks = [disk("/nvme", free_gib=1000, total_gib=2000)]
    with pytest.raises(PlanError, match="lmcache_max_local_disk_size=2000"):
        plan_tiers(host(1, 50, disks=disks), LLAMA8B, S(overrides=TierOverrides(disk_size_gib=2000)))
    with pytest.raises(PlanError, match="lmcache_local_disk=/elsewhere"):
        plan_tiers(host(1, 50, disks=disks), LLAMA8B, S(overrides=TierOverrides(disk_path="/elsewhere")))
    plan = plan_tiers(host(1, 50, disks=disks), LLAMA8B,
                      S(overrides=TierOverrides(disk_path="file:///nvme/kv/", disk_size_gib=10, use_odirect=False)))
    assert plan.disk.path == "/nvme/kv" and plan.disk.bytes_per_rank == 10 * GIB and not plan.disk.use_odirect
    off = plan_tiers(host(1, 50, disks=disks), LLAMA8B, S(overrides=TierOverrides(disk_size_gib=0)))
    assert not off.disk.enabled


def test_chunk_default_and_override_checked_against_block_size() -> None:
    assert plan_tiers(host(1), LLAMA8B, S()).chunk_size == 256
    assert plan_tiers(host(1), LLAMA8B, S(overrides=TierOverrides(chunk_size=512))).chunk_size == 512
    with pytest.raises(PlanError, match="lmcache_chunk_size=100"):
        plan_tiers(host(1), LLAMA8B, S(overrides=TierOverrides(chunk_size=100)))
    cpu_host = HostSnapshot(gpus=[], memory=memory(100), disks=[])
    with pytest.raises(PlanError, match="block size 128"):
        plan_tiers(cpu_host, LLAMA8B, S(overrides=TierOverrides(chunk_size=64)))


def test_chunk_grows_for_tiny_per_token_bytes() -> None:
    tiny = PlanModel(KvLayout(2, 1, 64, "bfloat16"), GIB, 65536, "tiny")  # 512 B/token
    plan = plan_tiers(host(1), tiny, S())
    assert plan.chunk_size == 512  # 512 x 512 B = 256 KiB
    assert plan.chunk_size * plan.kv_bytes_per_token_per_rank >= 256 * 1024


def test_chunk_shrinks_to_short_max_model_len() -> None:
    plan = plan_tiers(host(1), LLAMA8B, S(max_model_len=100))
    assert plan.chunk_size == 96


def test_lmi_reference_formula() -> None:
    snap = host(8, available_gib=1000, disks=[disk("/tmp", free_gib=500, total_gib=1000)])
    ref = lmi_reference(snap, 100 * GIB, 8)
    assert ref.cpu_gib_per_rank == 100  # (1000 - max(200, 200)) / 8
    assert ref.disk_gib_per_rank == 100  # TOTAL /tmp, not free
    ref = lmi_reference(snap, 10 * GIB, 8)
    assert ref.cpu_gib_per_rank == 100  # 20% wins over 2 x 10
    assert lmi_reference(host(1, 100), GIB, 1).disk_gib_per_rank is None


def test_gib_floor_bytes_never_rounds_up_and_renders_exactly() -> None:
    for value in (0, 1, GIB - 1, GIB, 3 * GIB + 12345, 10**13 + 7):
        rounded = gib_floor_bytes(value)
        assert rounded <= value
        assert value - rounded < GIB / 100 + 1
        hundredths = rounded * 100 // GIB
        assert math.isclose(hundredths / 100, round(rounded / GIB, 2))


def test_to_dict_contract_has_integer_byte_counts() -> None:
    data = plan_tiers(host(2, 500, disks=[disk("/nvme", free_gib=900)]), LLAMA8B, S(tp=2)).to_dict()
    for key in ("kv_bytes_per_token", "kv_bytes_per_token_per_rank", "weights_bytes"):
        assert type(data["model"][key]) is int
    assert set(data["parallel"]) >= {"tp", "pp", "dp", "ranks_per_host"}
    assert type(data["gpu"]["kv_capacity_tokens"]) is int
    for tier in ("cpu", "disk"):
        assert set(data["tiers"][tier]) >= {"enabled", "bytes_per_rank", "capacity_tokens"}
        assert type(data["tiers"][tier]["bytes_per_rank"]) is int
    assert "path" in data["tiers"]["disk"]
    assert data["vllm_args"][0] == "--kv-transfer-config"
    assert isinstance(data["warnings"], list) and data["explanation"]


def test_model_info_like_object_is_accepted() -> None:
    class Kv:
        layout = LLAMA8B.layout
        max_position_embeddings = 4096

    class Info:
        name = "duck"
        kv = Kv()
        weights_bytes = 16 * GIB

    plan = plan_tiers(HostSnapshot(gpus=gpus(1), memory=memory(100), disks=[]), Info(), S())
    assert plan.model_name == "duck" and plan.max_model_len == 4096

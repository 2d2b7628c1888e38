"""SageMaker instance catalog: rows, lookups with did-you-mean, synthesized host snapshots."""
from __future__ import annotations

import json

import pytest

from autoconfig.probe.catalog import (
    HOST_RAM_RESERVE_MIN_BYTES,
    INSTANCE_STORE_MOUNT,
    UnknownInstanceError,
    get_instance,
    host_snapshot_for,
    list_instances,
)
from autoconfig.probe.snapshot import HostSnapshot
from lmi_cache.errors import UserError

GiB = 1024**3
GB = 10**9
SIZES = ["xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge", "24xlarge", "48xlarge"]
REQUIRED = ([f"ml.{fam}.{size}" for fam in ("g5", "g6", "g6e") for size in SIZES]
            + ["ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.p5.48xlarge", "ml.p5e.48xlarge", "ml.p5en.48xlarge"])


def test_required_rows_present() -> None:
    names = {i.name for i in list_instances()}
    assert set(REQUIRED) <= names


@pytest.mark.parametrize("row", list_instances(), ids=lambda r: r.name)
def test_rows_are_consistent(row) -> None:  # type: ignore[no-untyped-def]
    assert row.source.startswith("https://aws.amazon.com/")
    assert row.gpu_count in (1, 4, 8) and row.vcpus >= 4 and row.host_memory_bytes >= 16 * GiB
    assert row.nvme_bytes == row.nvme_device_count * row.nvme_device_bytes > 0
    # NVML reports a little less than the marketing figure, never more.
    assert 0.9 * row.gpu_memory_bytes < row.gpu_memory_nvml_bytes <= row.gpu_memory_bytes


@pytest.mark.parametrize("name,gpus,model,gpu_gib,ram_gib,vcpus,nvme", [
    ("ml.g5.xlarge", 1, "A10G", 24, 16, 4, (1, 250)),
    ("ml.g5.12xlarge", 4, "A10G", 24, 192, 48, (1, 3800)),
    ("ml.g5.48xlarge", 8, "A10G", 24, 768, 192, (2, 3800)),
    ("ml.g6.12xlarge", 4, "L4", 24, 192, 48, (4, 940)),
    ("ml.g6e.xlarge", 1, "L40S", 48, 32, 4, (1, 250)),
    ("ml.g6e.48xlarge", 8, "L40S", 48, 1536, 192, (4, 1900)),
    ("ml.p4d.24xlarge", 8, "A100-40GB", 40, 1152, 96, (8, 1000)),
    ("ml.p4de.24xlarge", 8, "A100-80GB", 80, 1152, 96, (8, 1000)),
    ("ml.p5.48xlarge", 8, "H100", 80, 2048, 192, (8, 3840)),
    ("ml.p5e.48xlarge", 8, "H200", 141, 2048, 192, (8, 3840)),
    ("ml.p5en.48xlarge", 8, "H200", 141, 2048, 192, (8, 3840)),
])
def test_published_figures(name: str, gpus: int, model: str, gpu_gib: int, ram_gib: int, vcpus: int,
                           nvme: tuple[int, int]) -> None:
    row = get_instance(name)
    assert (row.gpu_count, row.gpu_model, row.vcpus) == (gpus, model, vcpus)
    assert row.gpu_memory_bytes == gpu_gib * GiB and row.host_memory_bytes == ram_gib * GiB
    assert (row.nvme_device_count, row.nvme_device_bytes) == (nvme[0], nvme[1] * GB)


@pytest.mark.parametrize("spelling", ["ml.g6e.12xlarge", "g6e.12xlarge", " ML.G6E.12XLARGE "])
def test_lookup_spellings(spelling: str) -> None:
    assert get_instance(spelling).name == "ml.g6e.12xlarge"


@pytest.mark.parametrize("typo,suggestion", [
    ("ml.g5.12xlarg", "ml.g5.12xlarge"),
    ("ml.p5.48xl", "ml.p5.48xlarge"),
    ("ml.g6e.2xlage", "ml.g6e.2xlarge"),
])
def test_did_you_mean(typo: str, suggestion: str) -> None:
    with pytest.raises(UnknownInstanceError) as err:
        get_instance(typo)
    message = str(err.value)
    assert isinstance(err.value, UserError) and "\n" not in message
    assert f"'{typo}'" in message and "did you mean" in message and suggestion in message


def test_unknown_without_close_match_lists_families() -> None:
    with pytest.raises(UnknownInstanceError, match="known families: .*ml.p5en"):
        get_instance("ml.zz9.nothing")


@pytest.mark.parametrize("name", ["ml.g5.2xlarge", "ml.g6e.24xlarge", "ml.p5.48xlarge"])
def test_host_snapshot(name: str) -> None:
    row = get_instance(name)
    snap = host_snapshot_for(name)
    assert len(snap.gpus) == row.gpu_count and [g.index for g in snap.gpus] == list(range(row.gpu_count))
    assert all(g.memory_free_bytes == g.memory_total_bytes == row.gpu_memory_nvml_bytes for g in snap.gpus)
    mem = snap.memory
    assert mem.total_bytes == row.host_memory_bytes and mem.cgroup_limit_bytes is None
    reserve = mem.total_bytes - mem.available_bytes
    assert reserve >= HOST_RAM_RESERVE_MIN_BYTES and reserve <= 0.05 * mem.total_bytes + HOST_RAM_RESERVE_MIN_BYTES
    store = [d for d in snap.disks if d.mount == INSTANCE_STORE_MOUNT]
    assert len(store) == 1 and store[0].nvme and store[0].rotational is False
    assert store[0].total_bytes == store[0].free_bytes == row.nvme_bytes
    root = [d for d in snap.disks if d.mount == "/"]
    assert len(root) == 1 and root[0].is_overlay and root[0].free_bytes < 16 * GiB
    assert snap.cpu_count == row.vcpus
    # The synthesized snapshot obeys the probe's JSON contract.
    assert HostSnapshot.from_dict(json.loads(json.dumps(snap.to_dict()))) == snap


def test_model_download_takes_nvme_space() -> None:
    full = host_snapshot_for("ml.g5.12xlarge")
    used = host_snapshot_for("ml.g5.12xlarge", model_bytes_on_disk=16 * GB)
    store = {d.mount: d for d in used.disks}[INSTANCE_STORE_MOUNT]
    assert store.free_bytes == {d.mount: d for d in full.disks}[INSTANCE_STORE_MOUNT].free_bytes - 16 * GB


def test_unknown_instance_snapshot_is_user_error() -> None:
    with pytest.raises(UnknownInstanceError):
        host_snapshot_for("ml.g7.xlarge")

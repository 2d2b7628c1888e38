"""HostSnapshot JSON contract: round trip and one-line errors for bad files."""
from __future__ import annotations

import pytest

from autoconfig.probe.snapshot import HostSnapshot, SnapshotError

GOOD = {
    "gpus": [{"index": 0, "name": "NVIDIA L40S", "memory_total_bytes": 48 << 30, "memory_free_bytes": 47 << 30}],
    "memory": {
        "total_bytes": 384 << 30,
        "available_bytes": 370 << 30,
        "cgroup_limit_bytes": 200 << 30,
        "memlock_limit_bytes": None,
        "shm_bytes": 64 << 30,
        "cgroup_usage_bytes": 10 << 30,
    },
    "disks": [
        {
            "mount": "/tmp", "device": "nvme0n1", "fs_type": "xfs", "total_bytes": 3800 << 30,
            "free_bytes": 3700 << 30, "rotational": False, "nvme": True, "odirect": True,
        }
    ],
}


def test_round_trip_and_usable_memory() -> None:
    snap = HostSnapshot.from_dict(GOOD, "host.json")
    assert HostSnapshot.from_dict(snap.to_dict()) == snap
    # usable = min(available, cgroup limit - usage)
    assert snap.memory.usable_bytes == (200 - 10) << 30


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.pop("memory"), "missing key 'memory'"),
        (lambda d: d["memory"].pop("shm_bytes"), "memory.shm_bytes"),
        (lambda d: d["disks"][0].__setitem__("nvme", "yes"), "disks[0].nvme"),
        (lambda d: d["gpus"][0].__setitem__("memory_total_bytes", -1), "memory_total_bytes' must be from 0"),
        (lambda d: d["memory"].__setitem__("available_bytes", 10**400), "available_bytes' must be from 0"),
        (lambda d: d["disks"][0].__setitem__("mount", "tmp/cache"), "must be an absolute path"),
        (lambda d: d["disks"][0].__setitem__("mount", ""), "must be an absolute path"),
        (lambda d: d.__setitem__("cpu_count", -3), "cpu_count"),
    ],
)
def test_bad_snapshot_names_file_and_key(mutate, needle) -> None:  # type: ignore[no-untyped-def]
    import copy

    data = copy.deepcopy(GOOD)
    mutate(data)
    with pytest.raises(SnapshotError) as err:
        HostSnapshot.from_dict(data, "host.json")
    assert "host.json" in str(err.value) and needle in str(err.value)
    assert "\n" not in str(err.value)


def test_a_mount_with_a_control_character_round_trips_but_is_never_chosen() -> None:
    import copy

    from autoconfig.plan.disk import choose_disk

    data = copy.deepcopy(GOOD)
    data["disks"][0]["mount"] = "/mnt/a\nb"  # possible on a real host: /proc/mounts escapes it as \012
    snap = HostSnapshot.from_dict(data, "host.json")
    assert snap.disks[0].mount == "/mnt/a\nb" and choose_disk(snap) is None

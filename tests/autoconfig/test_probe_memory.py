"""Tests for autoconfig.probe.memory / cgroups against fake procfs and cgroup trees."""
from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoconfig.probe.cgroups import probe_cgroup_memory
from autoconfig.probe.memory import (
    memlock_limit_bytes,
    parse_meminfo,
    probe_memory,
    ram_from_meminfo,
    shm_size_bytes,
)

try:
    from .probe_trees import V1_UNLIMITED, cgroup_v1_dir, cgroup_v2_dir, mount_line, write_proc
except ImportError:  # tests/ laid out without __init__.py files
    from probe_trees import V1_UNLIMITED, cgroup_v1_dir, cgroup_v2_dir, mount_line, write_proc

GIB = 1024**3
ROOT_MOUNT = mount_line(27, 1, "254:0", "/", "/", "ext4", "/dev/vda")
MEMINFO = "MemTotal:       32768000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\nHugePages_Total:       0\n"


def v2_mount(root: str = "/") -> str:
    return mount_line(31, 23, "0:28", root, "/sys/fs/cgroup", "cgroup2", "cgroup2", "rw,nosuid", "rw,nsdelegate")


def v1_memory_mount(root: str = "/") -> str:
    return mount_line(35, 31, "0:32", root, "/sys/fs/cgroup/memory", "cgroup", "cgroup", "rw,nosuid", "rw,memory")


def v1_cpu_mount() -> str:
    return mount_line(32, 31, "0:29", "/", "/sys/fs/cgroup/cpu,cpuacct", "cgroup", "cgroup", "rw", "rw,cpu,cpuacct")


# --- /proc/meminfo -------------------------------------------------------------------------------


def test_parse_meminfo_converts_kib_to_bytes_and_keeps_unitless_counts() -> None:
    values = parse_meminfo(MEMINFO)
    assert values["MemTotal"] == 32768000 * 1024
    assert values["MemAvailable"] == 20000000 * 1024
    assert values["HugePages_Total"] == 0
    assert ram_from_meminfo(values) == (32768000 * 1024, 20000000 * 1024)


@given(st.dictionaries(st.from_regex(r"[A-Za-z_()]{1,20}", fullmatch=True), st.integers(0, 2**50), max_size=20))
def test_parse_meminfo_round_trips_any_kib_table(table: dict[str, int]) -> None:
    text = "".join(f"{key}:{' ' * 5}{value} kB\n" for key, value in table.items())
    assert parse_meminfo(text) == {key: value * 1024 for key, value in table.items()}


def test_old_kernel_without_memavailable_estimates_from_free_buffers_cached() -> None:
    values = parse_meminfo("MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 20 kB\nCached: 300 kB\n")
    assert ram_from_meminfo(values) == (1000 * 1024, 420 * 1024)


def test_garbage_lines_are_skipped() -> None:
    assert parse_meminfo("nonsense\nMemTotal: lots kB\nFoo: 12 parsecs\nBar: 7 kB\n") == {"Bar": 7 * 1024}


# --- cgroup v2 --------------------------------------------------------------------------------------


def test_v2_limit_on_parent_is_found_when_own_cgroup_is_unlimited(tmp_path: Path) -> None:
    cg = tmp_path / "sys" / "fs" / "cgroup"
    cgroup_v2_dir(cg, "/", None, None)  # the root cgroup has no memory.max
    cgroup_v2_dir(cg, "/kubepods", "max", 30 * GIB)
    cgroup_v2_dir(cg, "/kubepods/pod1", str(8 * GIB), 3 * GIB)
    cgroup_v2_dir(cg, "/kubepods/pod1/ctr", "max", 2 * GIB)
    proc = write_proc(tmp_path / "proc", [ROOT_MOUNT, v2_mount()], "0::/kubepods/pod1/ctr\n")

    found = probe_cgroup_memory(str(proc), str(tmp_path))

    assert (found.limit_bytes, found.usage_bytes, found.version) == (8 * GIB, 3 * GIB, 2)
    assert found.path == str(cg / "kubepods" / "pod1")


def test_v2_max_everywhere_means_no_limit_but_reports_own_usage(tmp_path: Path) -> None:
    cg = tmp_path / "sys" / "fs" / "cgroup"
    cgroup_v2_dir(cg, "/", None, None)
    cgroup_v2_dir(cg, "/user.slice", "max", 5 * GIB)
    cgroup_v2_dir(cg, "/user.slice/session-1.scope", "max", GIB)
    proc = write_proc(tmp_path / "proc", [ROOT_MOUNT, v2_mount()], "0::/user.slice/session-1.scope\n")

    found = probe_cgroup_memory(str(proc), str(tmp_path))

    assert (found.limit_bytes, found.usage_bytes) == (None, GIB)


def test_v2_in_a_cgroup_namespace_reads_the_mount_itself(tmp_path: Path) -> None:
    # Docker with cgroupns: our cgroup is "/" and the mount shows the container's own directory.
    cg = tmp_path / "sys" / "fs" / "cgroup"
    cgroup_v2_dir(cg, "/", str(4 * GIB), GIB // 2)
    proc = write_proc(tmp_path / "proc", [ROOT_MOUNT, v2_mount()], "0::/\n")

    found = probe_cgroup_memory(str(proc), str(tmp_path))

    assert (found.limit_bytes, found.usage_bytes) == (4 * GIB, GIB // 2)


def test_parent_with_least_headroom_wins_over_smaller_child_limit(tmp_path: Path) -> None:
    cg = tmp_path / "sys" / "fs" / "cgroup"
    cgroup_v2_dir(cg, "/pod", str(10 * GIB), 9 * GIB)  # siblings use most of it
    cgroup_v2_dir(cg, "/pod/ctr", str(8 * GIB), GIB)
    proc = write_proc(tmp_path / "proc", [ROOT_MOUNT, v2_mount()], "0::/pod/ctr\n")

    found = probe_cgroup_memory(str(proc), str(tmp_path))

    assert (found.limit_bytes, found.usage_bytes) == (10 * GIB, 9 * GIB)


# --- cgroup v1 and hybrid -----------------------------------------------------------------------------


def test_v1_docker_style_mount_rooted_at_own_cgroup(tmp_path: Path) -> None:
    mem = tmp_path / "sys" / "fs" / "cgroup" / "memory"
    cgroup_v1_dir(mem, "/", 2 * GIB, 300 * 1024**2)
    proc = write_proc(
        tmp_path / "proc",
        [ROOT_MOUNT, v1_cpu_mount(), v1_memory_mount("/docker/abc")],
        "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n",
    )

    found = probe_cgroup_memory(str(proc), str(tmp_path))

    assert (found.limit_bytes, found.usage_bytes, found.version) == (2 * GIB, 300 * 1024**2, 1)


def test_v1_unlimited_child_under_limited_parent(tmp_path: Path) -> None:
    mem = tmp_path / "sys" / "fs" / "cgroup" / "memory"
    cgroup_v1_dir(mem, "/", V1_UNLIMITED, 50 * GIB)
    cgroup_v1_dir(mem, "/process_api", 6 * GIB, 2 * GIB)
    cgroup_v1_dir(mem, "/process_api/d7ab", V1_UNLIMITED, GIB)
    proc = write_proc(tmp_path / "proc", [ROOT_MOUNT, v1_memory_mount()], "4:memory:/process_api/d7ab\n")

    found = probe_cgroup_memory(str(proc), str(tmp_path))

    assert (found.limit_bytes, found.usage_bytes) == (6 * GIB, 2 * GIB)


def test_v1_unlimited_value_means_no_limit(tmp_path: Path) -> None:
    mem = tmp_path / "sys" / "fs" / "cgroup" / "memory"
    cgroup_v1_dir(mem, "/", V1_UNLIMITED, 50 * GIB)
    cgroup_v1_dir(mem, "/job", V1_UNLIMITED, 3 * GIB)
    proc = write_proc(tmp_path / "proc", [ROOT_MOUNT, v1_memory_mount()], "4:memory:/job\n")

    found = probe_cgroup_memory(str(proc), str(tmp_path))

    assert (found.limit_bytes, found.usage_bytes) == (None, 3 * GIB)


def test_hybrid_host_reads_the_v1_memory_controller_not_the_empty_v2_tree(tmp_path: Path) -> None:
    base = tmp_path / "sys" / "fs" / "cgroup"
    cgroup_v1_dir(base / "memory", "/svc", 3 * GIB, GIB)
    (base / "unified" / "svc").mkdir(parents=True)  # v2 holds no memory files on hybrid hosts
    unified = mount_line(41, 31, "0:38", "/", "/sys/fs/cgroup/unified", "cgroup2", "cgroup2", "rw", "rw")
    proc = write_proc(
        tmp_path / "proc", [ROOT_MOUNT, v1_memory_mount(), unified], "4:memory:/svc\n0::/svc\n"
    )

    found = probe_cgroup_memory(str(proc), str(tmp_path))

    assert (found.limit_bytes, found.version) == (3 * GIB, 1)


def test_no_cgroup_information_means_no_limit(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    assert probe_cgroup_memory(str(proc), str(tmp_path)).limit_bytes is None
    # A cgroup file but no cgroup mount at all (e.g. a chroot without /sys)
    write_proc(proc, [ROOT_MOUNT], "0::/foo\n")
    assert probe_cgroup_memory(str(proc), str(tmp_path)).version is None


# --- memlock, /dev/shm, the whole probe -----------------------------------------------------------------


def test_memlock_unlimited_is_none_and_finite_is_bytes() -> None:
    assert memlock_limit_bytes(lambda _r: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)) is None
    assert memlock_limit_bytes(lambda _r: (65536, 131072)) == 65536
    assert memlock_limit_bytes() == (
        None if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY
        else resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    )


def test_shm_size_of_real_dev_shm_and_absent_path(tmp_path: Path) -> None:
    if os.path.isdir("/dev/shm"):
        st_shm = os.statvfs("/dev/shm")
        assert shm_size_bytes("/dev/shm") == st_shm.f_blocks * st_shm.f_frsize > 0
    assert shm_size_bytes(str(tmp_path / "no-such-dir")) == 0


def test_probe_memory_combines_all_sources(tmp_path: Path) -> None:
    cg = tmp_path / "sys" / "fs" / "cgroup"
    cgroup_v2_dir(cg, "/ctr", str(16 * GIB), 5 * GIB)
    proc = write_proc(tmp_path / "proc", [ROOT_MOUNT, v2_mount()], "0::/ctr\n", MEMINFO)

    info = probe_memory(
        proc_root=str(proc),
        shm_path=str(tmp_path / "absent-shm"),
        getrlimit=lambda _r: (64 * 1024**2, 64 * 1024**2),
        mount_root=str(tmp_path),
    )

    assert info.total_bytes == 32768000 * 1024
    assert info.available_bytes == 20000000 * 1024
    assert (info.cgroup_limit_bytes, info.cgroup_usage_bytes) == (16 * GIB, 5 * GIB)
    assert info.memlock_limit_bytes == 64 * 1024**2
    assert info.shm_bytes == 0
    assert info.usable_bytes == 11 * GIB


@pytest.mark.parametrize("content", ["", "garbage\n", "-1\n"])
def test_unreadable_limit_files_count_as_no_limit(tmp_path: Path, content: str) -> None:
    cg = tmp_path / "sys" / "fs" / "cgroup"
    d = cg / "ctr"
    d.mkdir(parents=True)
    (d / "memory.max").write_text(content)
    proc = write_proc(tmp_path / "proc", [ROOT_MOUNT, v2_mount()], "0::/ctr\n")
    assert probe_cgroup_memory(str(proc), str(tmp_path)).limit_bytes is None

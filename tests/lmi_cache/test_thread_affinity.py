"""The cache's threads leave the core vLLM's CPU backend pins its model thread to."""
from __future__ import annotations

import os
import threading

import pytest

from lmi_cache import thread_affinity
from lmi_cache.thread_affinity import io_thread_cpus, openmp_bound_cpus, parse_cpu_list


def test_cpu_lists_in_the_spellings_cgroups_and_openmp_use() -> None:
    assert parse_cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpu_list("0 1 2") == {0, 1, 2}
    assert parse_cpu_list("0-6:2\n") == {0, 2, 4, 6}
    for bad in ("3-1", "x", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_openmp_cpus_from_the_environment_vllm_sets() -> None:
    assert openmp_bound_cpus({"GOMP_CPU_AFFINITY": "0 1"}) == {0, 1}
    assert openmp_bound_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3]"}) == {2, 3}
    assert openmp_bound_cpus({"GOMP_CPU_AFFINITY": "zero"}) == set()  # unreadable: as if unset
    assert openmp_bound_cpus({}) == set()


def test_io_threads_prefer_cores_openmp_does_not_use() -> None:
    assert io_thread_cpus({0, 1, 2, 3}, {0, 1, 2}) == {3}  # a core reserved for other work
    assert io_thread_cpus({0, 1}, {0, 1}) == {0, 1}  # every core runs OpenMP: share them all
    assert io_thread_cpus({0, 1}, set()) == {0, 1}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin one thread to one of them")
def test_a_reader_thread_started_by_a_pinned_thread_is_not_pinned(tmp_path: object) -> None:
    from lmi_cache.tiers.disk.reads import DiskReader

    allowed = os.sched_getaffinity(0)
    thread_affinity._target.cache_clear()
    seen: dict[str, set[int]] = {}

    def pinned_starter() -> None:
        os.sched_setaffinity(0, {min(allowed)})  # as vLLM's CPU backend pins the worker's main thread
        reader = DiskReader.__new__(DiskReader)  # only its thread pool is exercised here
        reader._num_workers, reader._pool, reader._pool_lock = 1, None, threading.Lock()
        seen["reader"] = reader._executor().submit(os.sched_getaffinity, 0).result()
        reader.close()
        seen["starter"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=pinned_starter)
    thread.start()
    thread.join()
    assert seen["starter"] == {min(allowed)}
    assert len(seen["reader"]) >= 2 and seen["reader"] <= allowed | set(range(os.cpu_count() or 1))

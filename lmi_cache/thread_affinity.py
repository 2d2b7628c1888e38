"""Which CPUs the cache's own threads run on (any process that starts them; torch-free).

vLLM's CPU backend binds its OpenMP threads one per core, the worker's main
thread included (GOMP_CPU_AFFINITY / KMP_AFFINITY), and a thread inherits the
affinity of the thread that starts it. Our disk readers and writers, remote
I/O and the allocator's warmer are started from that main thread, so without
this module they all share the one core of the model's OpenMP master thread,
and a copy kernel call waits for that core while disk reads run on it: on a
busy 2-core host a fresh server's disk hits cost 2.15x a CPU-tier hit of the
same documents, 1.26x with this module and one copy per step after the reads
(``benchmarks/bench_connector.py --configs ours-disk``, paired rows).

Our threads therefore widen their own affinity when they start: to the CPUs
the container may use (the cgroup's effective cpuset, else all), minus the
CPUs vLLM bound OpenMP threads to when any are left (a host that reserves
cores for the frontend), else all of them (every core runs OpenMP; sharing
them all beats piling onto one). On GPU hosts nothing is pinned and the
affinity is left as it is. Any failure leaves the thread as it was.
"""
from __future__ import annotations

import functools
import logging
import os
import re

logger = logging.getLogger(__name__)

_CPUSET_FILES = ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus")


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8 10"`` -> {0, 1, 2, 3, 8, 10}; ``a-b:stride`` ranges too. ValueError on anything else."""
    cpus: set[int] = set()
    for part in re.split(r"[\s,]+", text.strip()):
        if not part:
            continue
        span, _, stride = part.partition(":")
        first, _, last = span.partition("-")
        start, end = int(first), int(last) if last else int(first)
        if start < 0 or end < start:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(start, end + 1, int(stride) if stride else 1))
    return cpus


def openmp_bound_cpus(environ: dict[str, str] | None = None) -> set[int]:
    """The CPUs vLLM bound OpenMP threads to, from the environment it set (empty when none or unreadable)."""
    env = os.environ if environ is None else environ
    try:
        if env.get("GOMP_CPU_AFFINITY"):
            return parse_cpu_list(env["GOMP_CPU_AFFINITY"])
        match = re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", ""))
        if match:
            return parse_cpu_list(match.group(1))
    except ValueError:
        pass
    return set()


def allowed_cpus() -> set[int]:
    """The CPUs this container may use: the cgroup's effective cpuset, else every CPU of the host."""
    for path in _CPUSET_FILES:
        try:
            with open(path, encoding="ascii") as handle:
                cpus = parse_cpu_list(handle.read())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def io_thread_cpus(allowed: set[int], openmp: set[int]) -> frozenset[int]:
    """Where I/O threads go: the allowed CPUs OpenMP does not use when there are any, else all allowed."""
    free = allowed - openmp
    return frozenset(free or allowed)


@functools.lru_cache(maxsize=1)
def _target() -> frozenset[int] | None:
    if not hasattr(os, "sched_setaffinity"):
        return None
    return io_thread_cpus(allowed_cpus(), openmp_bound_cpus())


def unpin_current_thread() -> None:
    """Widen the calling thread's CPU affinity to ``io_thread_cpus`` (a thread initializer; never raises)."""
    target = _target()
    if not target:
        return
    try:
        if os.sched_getaffinity(0) != target:
            os.sched_setaffinity(0, target)  # pid 0: this thread only (Linux affinity is per thread)
    except OSError as err:
        logger.debug("lmi-cache: could not widen a thread's CPU affinity: %s", err)

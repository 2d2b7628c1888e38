"""Planner input checks: plans only promise what vLLM and the disk tier can really start with.

Pure functions called first by ``autoconfig.plan.planner.plan_tiers`` (container-start
process or the ``lmi-cache plan`` / ``validate`` CLI), before any arithmetic and
long before vLLM is imported. Each failure is one ``PlanError`` line naming the
option (the serving.properties / LMCache name) and what to do.
"""
from __future__ import annotations

import math

from autoconfig.probe.snapshot import HostSnapshot
from autoconfig.plan.disk import PSEUDO_FS_TYPES, mount_of, normalize_disk_path
from autoconfig.plan.types import PlanError, PlanModel
from autoconfig.plan.settings import ServingSettings

# Bounds far above any deployment; they keep every product below exact in floats and 64-bit ints.
MAX_PARALLEL_DEGREE = 1 << 12
MAX_MODEL_LEN = 1 << 40
MAX_SIZE_GIB = float(1 << 20)  # 1 PiB per rank
MAX_CHUNK_TOKENS = 1 << 16
# Kernel views: a directory below them can never be created or hold files (/dev/shm, a
# tmpfs, and any other filesystem the snapshot shows mounted below /dev excepted).
_KERNEL_TREES = ("/proc", "/sys", "/dev")
_WRITABLE_UNDER_DEV = ("/dev/shm",)


def check_settings(s: ServingSettings) -> None:
    """Types and ranges of every setting and override (CLI flags and serving.properties alike)."""
    for name, value in (("tensor_parallel_degree", s.tp), ("pipeline_parallel_degree", s.pp),
                        ("data_parallel_degree", s.dp)):
        if not _is_int(value) or not 1 <= value <= MAX_PARALLEL_DEGREE:
            raise PlanError(f"{name}={value!r:.30}: must be an integer from 1 to {MAX_PARALLEL_DEGREE}")
    if not _is_number(s.gpu_memory_utilization) or not 0 < s.gpu_memory_utilization <= 1:
        raise PlanError(f"gpu_memory_utilization={s.gpu_memory_utilization!r:.30}: must be in (0, 1]")
    if s.max_model_len is not None and (not _is_int(s.max_model_len) or not 1 <= s.max_model_len <= MAX_MODEL_LEN):
        raise PlanError(f"max_model_len={s.max_model_len!r:.30}: must be an integer from 1 to {MAX_MODEL_LEN}")
    if s.engine not in ("lmi_cache", "lmcache"):
        raise PlanError(f"engine={s.engine!r:.30}: use 'lmi_cache' or 'lmcache'")
    ov = s.overrides
    for name, size in (("lmcache_max_local_cpu_size", ov.cpu_size_gib), ("lmcache_max_local_disk_size", ov.disk_size_gib)):
        if size is not None and (not _is_number(size) or not 0 <= size <= MAX_SIZE_GIB):
            raise PlanError(f"{name}={size!r:.30}: must be a finite size in GiB per rank from 0 to "
                            f"{MAX_SIZE_GIB:.0f} (0 disables the tier)")
    if ov.chunk_size is not None and (not _is_int(ov.chunk_size) or not 1 <= ov.chunk_size <= MAX_CHUNK_TOKENS):
        raise PlanError(f"lmcache_chunk_size={ov.chunk_size!r:.30}: must be an integer from 1 to {MAX_CHUNK_TOKENS}")
    if ov.disk_path is not None:
        problem = disk_path_syntax_problem(ov.disk_path)
        if problem:
            raise PlanError(f"lmcache_local_disk={ov.disk_path[:80]!r}: {problem}")


def disk_path_syntax_problem(value: str) -> str | None:
    """Why ``value`` (a path or file:// URL) can never name a disk-tier directory, or None."""
    path = normalize_disk_path(value)
    if not path.strip():
        return "is empty; give an absolute directory such as /mnt/nvme/lmcache"
    if not path.startswith("/"):
        return "must be an absolute directory path (or file:///path/), not relative to where the server starts"
    if "," in path:
        return "contains a comma, which LMCache's local_disk format reads as two paths; choose a path without one"
    if any(ord(c) < 32 for c in path):
        return "contains a control character; choose a plain directory path"
    if len(path) > 4000:
        return "is longer than the system's PATH_MAX"
    return None


def check_disk_path_on_host(value: str, host: HostSnapshot) -> None:
    """A disk-tier directory under a kernel view (/proc, /sys, /dev or a pseudo filesystem) can never be created."""
    path = normalize_disk_path(value)
    disk = mount_of(host, path)
    inside_kernel_tree = any(path == tree or path.startswith(tree + "/") for tree in _KERNEL_TREES)
    if path.startswith("/dev/") and (
        any(path == d or path.startswith(d + "/") for d in _WRITABLE_UNDER_DEV)
        or (disk is not None and disk.mount.startswith("/dev/") and disk.fs_type not in PSEUDO_FS_TYPES)
    ):
        inside_kernel_tree = False
    if inside_kernel_tree or (disk is not None and disk.fs_type in PSEUDO_FS_TYPES):
        where = disk.fs_type if disk is not None and disk.fs_type in PSEUDO_FS_TYPES else "a kernel view"
        raise PlanError(f"lmcache_local_disk={value[:80]!r} is on {where}: that directory can never be created "
                        "or hold files; choose a path on a local disk such as /mnt/nvme/lmcache")


def check_parallel_fits_model(m: PlanModel, s: ServingSettings, num_gpus: int = 0) -> None:
    """vLLM refuses, at start, a tensor-parallel size that does not split the attention heads evenly.

    ``num_gpus`` (0: no GPU, any degree) limits the degrees suggested in the message.
    """
    heads = m.num_attention_heads
    tp = s.tp
    if heads and heads % tp:
        limit = min(heads, num_gpus or MAX_PARALLEL_DEGREE, MAX_PARALLEL_DEGREE)
        divisors = [d for d in range(1, limit + 1) if heads % d == 0][-6:]
        raise PlanError(f"tensor_parallel_degree={tp} does not divide the model's {heads} attention heads, so "
                        f"vLLM would refuse to start; use one of {', '.join(map(str, divisors))}")
    kv_heads = m.layout.num_kv_heads
    if not m.layout.is_mla and kv_heads > 0 and (tp % kv_heads if tp >= kv_heads else kv_heads % tp):
        raise PlanError(f"tensor_parallel_degree={tp} cannot split the model's {kv_heads} KV heads (vLLM needs "
                        f"one to be a multiple of the other); use a divisor or a multiple of {kv_heads}")
    layers = m.layout.num_layers
    if s.pp > layers:
        raise PlanError(f"pipeline_parallel_degree={s.pp} is larger than the model's {layers} layers; lower it")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))

"""CPU- and disk-tier sizing for the planner (host RAM and local disk, per rank).

Pure functions called by ``autoconfig.plan.planner.plan_tiers`` (container-start
process or the ``lmi-cache plan`` CLI). Each appends its one-line reasons to
``why`` and its warnings to ``warn``.
"""
from __future__ import annotations

import math

from autoconfig.probe.snapshot import HostSnapshot
from autoconfig.plan.disk import (
    cache_dir_on, choose_disk, disk_reserve_bytes, mount_of, normalize_disk_path, unsuitable_reason,
)
from autoconfig.plan.types import GIB, CpuTierPlan, DiskTierPlan, GpuPlan, PlanError, PlanModel
from autoconfig.plan.settings import ServingSettings

# Host RAM the serving processes need besides the cache tiers.
FRONTEND_BYTES = 2 * GIB  # API server + engine core + tokenizer
GPU_RANK_OVERHEAD_BYTES = 3 * GIB  # per GPU worker: torch, CUDA runtime, NCCL host buffers
CPU_RANK_OVERHEAD_BYTES = 1 * GIB  # per CPU worker: torch + oneDNN scratch
SAFETY_FRACTION = 0.10  # of usable RAM: page cache for weights, allocator slack, spikes
# RLIMIT_MEMLOCK below this is a container default, not a budget (see cpu_tier).
MEMLOCK_CAP_MIN_BYTES = 1 << 30


def blend_heap_bytes_per_rank(m: PlanModel, s: ServingSettings, max_model_len: int) -> int:
    """The heap a CPU worker that blends touches at start and keeps (``lmi_cache.blend.host_heap``); 0 if it does not."""
    if not (s.blend.enabled and s.blend_connector):
        return 0
    from lmi_cache.blend.host_heap import blend_heap_bytes

    layout = m.layout
    return blend_heap_bytes(layout.layers_per_rank(s.pp), layout.kv_heads_per_rank(s.tp), layout.head_dim,
                            max_model_len)


def _serving_needs(m: PlanModel, s: ServingSettings, gpu: GpuPlan, ranks: int, max_model_len: int) -> tuple[int, str]:
    if gpu.backend == "cuda":
        need = FRONTEND_BYTES + ranks * GPU_RANK_OVERHEAD_BYTES
        text = (f"frontend {_gib(FRONTEND_BYTES)} + {ranks} x {_gib(GPU_RANK_OVERHEAD_BYTES)} per GPU worker "
                "(weights load through the reclaimable page cache)")
        return need, text
    weights_rank = math.ceil(m.weights_bytes / (s.tp * s.pp))
    per_rank = CPU_RANK_OVERHEAD_BYTES + weights_rank + gpu.kv_bytes_per_rank
    text = (f"frontend {_gib(FRONTEND_BYTES)} + {ranks} x (overhead {_gib(CPU_RANK_OVERHEAD_BYTES)} + weights "
            f"{_gib(weights_rank)} + VLLM_CPU_KVCACHE_SPACE {_gib(gpu.kv_bytes_per_rank)}")
    heap = blend_heap_bytes_per_rank(m, s, max_model_len)
    if heap:  # blending on the CPU backend keeps a prewarmed heap for its temporaries
        per_rank += heap
        text += f" + blend heap {_gib(heap)}"
    return FRONTEND_BYTES + ranks * per_rank, text + ") per CPU worker"


def cpu_tier(host: HostSnapshot, m: PlanModel, s: ServingSettings, gpu: GpuPlan, bpt_rank: int, ranks: int,
              chunk: int, why: list[str], warn: list[str], max_model_len: int) -> CpuTierPlan:
    """RAM per rank: usable minus serving needs and a margin, over all ranks; on only if it beats the GPU cache."""
    mem = host.memory
    usable = mem.usable_bytes
    need, need_text = _serving_needs(m, s, gpu, ranks, max_model_len)
    margin = int(usable * SAFETY_FRACTION)
    if need > usable:
        warn.append(f"the serving processes need about {_gib(need)} of RAM but only {_gib(usable)} is usable "
                    "(available RAM / cgroup headroom): they may be OOM-killed")
    hard = max(0, usable - need) // ranks
    fit = max(0, usable - need - margin) // ranks
    bound = (f"usable RAM {_gib(usable)} (min of available and cgroup headroom) - needs {_gib(need)} "
             f"[{need_text}] - 10% margin {_gib(margin)}, / {ranks} rank(s)")
    memlock = mem.memlock_limit_bytes
    if gpu.backend == "cuda" and memlock is not None and memlock < fit:
        if memlock < MEMLOCK_CAP_MIN_BYTES:
            # A container default (64 KiB-8 MiB), not a deliberate budget: capping to it
            # would turn the tier off; the engine falls back to pageable memory instead.
            warn.append(f"memlock limit {_size(memlock)} is tiny: pinning the CPU tier will fail and fall back "
                        "to pageable memory (slower GPU<->CPU copies); run the container with --ulimit memlock=-1")
        else:
            warn.append(f"memlock limit {_gib(memlock)} is below the CPU tier's {_gib(fit)} per rank: the tier "
                        "is capped to it so that it can be pinned (run the container with --ulimit memlock=-1)")
            fit = hard = min(hard, memlock)
            bound += f", capped by memlock {_gib(memlock)}"
    override = s.overrides.cpu_size_gib
    if override is not None:
        want = gib_floor_bytes(int(override * GIB))
        if want == 0:
            why.append("tiers.cpu = off: lmcache_max_local_cpu_size=0")
            return CpuTierPlan(False, 0, 0, fit)
        if want > hard:
            raise PlanError(f"lmcache_max_local_cpu_size={override} GiB per rank does not fit: at most "
                            f"{_gib(hard)} per rank ({bound}); lower it or unset it")
        if want > fit:
            warn.append(f"lmcache_max_local_cpu_size={override} GiB eats into the 10% RAM safety margin")
        tokens = want // bpt_rank // chunk * chunk
        if tokens <= gpu.kv_capacity_tokens:
            warn.append(f"CPU tier ({tokens:,} tokens) is not larger than the GPU KV cache "
                        f"({gpu.kv_capacity_tokens:,}): it only mirrors it")
        why.append(f"tiers.cpu = {_gib(want)} per rank ({tokens:,} tokens): lmcache_max_local_cpu_size; fits {bound}")
        return CpuTierPlan(True, want, tokens, fit)
    size = gib_floor_bytes(fit)
    tokens = size // bpt_rank // chunk * chunk
    if tokens <= gpu.kv_capacity_tokens:
        warn.append(f"CPU tier off: {_gib(size)} per rank holds {tokens:,} tokens, not more than the GPU KV "
                    f"cache's {gpu.kv_capacity_tokens:,} (it would only mirror it)")
        why.append(f"tiers.cpu = off: {bound} = {_gib(fit)} is no larger than the GPU KV cache")
        return CpuTierPlan(False, 0, 0, fit)
    why.append(f"tiers.cpu = {_gib(size)} per rank ({tokens:,} tokens): {bound}, rounded down to 0.01 GiB")
    return CpuTierPlan(True, size, tokens, fit)


def disk_tier(host: HostSnapshot, s: ServingSettings, gpu: GpuPlan, cpu: CpuTierPlan, bpt_rank: int,
               ranks: int, chunk: int, why: list[str], warn: list[str]) -> DiskTierPlan:
    """Free space minus a reserve on the best local disk, over all ranks; on only if it beats the tiers above."""
    ov = s.overrides
    off = DiskTierPlan(False, None, None, 0, 0, False, 0)
    if ov.disk_size_gib is not None and gib_floor_bytes(int(ov.disk_size_gib * GIB)) == 0:
        why.append("tiers.disk = off: lmcache_max_local_disk_size=0")
        if ov.disk_path:  # said, not dropped silently: the user named a directory that nothing will use
            warn.append(f"lmcache_local_disk={ov.disk_path} is not used: lmcache_max_local_disk_size=0 turns the "
                        "disk tier off; give a size, or remove the directory setting")
        return off
    if ov.disk_path:
        path = normalize_disk_path(ov.disk_path)
        disk = mount_of(host, path)
        if disk is None and ov.disk_size_gib is None:
            raise PlanError(f"lmcache_local_disk={ov.disk_path} is on no filesystem the probe found: set "
                            "lmcache_max_local_disk_size too, or choose a path under a probed mount")
        if disk is not None and not disk.writable:
            raise PlanError(f"lmcache_local_disk={ov.disk_path}: {disk.mount} is not writable; choose another path")
        if disk is not None and (reason := unsuitable_reason(disk)):
            warn.append(f"lmcache_local_disk={ov.disk_path}: {reason}; using it as asked")
        where = "lmcache_local_disk"
    else:
        disk = choose_disk(host)
        if disk is None:
            reasons = "; ".join(r for d in host.disks if (r := unsuitable_reason(d)))[:300] or "no disks probed"
            warn.append(f"disk tier off: no writable local non-tmpfs, non-network, non-rotational filesystem ({reasons})")
            why.append("tiers.disk = off: no suitable local disk")
            return off
        path = cache_dir_on(host, disk)
        where = f"best local disk: {disk.device} ({'NVMe' if disk.nvme else 'SSD/unknown'}, {disk.fs_type})"
        if disk.fs_type == "overlay" or disk.is_overlay:
            warn.append(f"disk tier on the container's overlay filesystem {disk.mount}: its backing device is "
                        "unknown; mount a local NVMe volume for a faster disk tier")
    odirect = ov.use_odirect if ov.use_odirect is not None else bool(disk is not None and disk.odirect is True)
    if ov.use_odirect and disk is not None and disk.odirect is False:
        warn.append(f"lmcache_use_odirect=true but O_DIRECT opens failed on {disk.mount} in the probe")
    if disk is None:
        size = gib_floor_bytes(int((ov.disk_size_gib or 0) * GIB))
        warn.append(f"lmcache_local_disk={path} is not on a probed filesystem: its size is taken as given, unchecked")
        tokens = size // bpt_rank // chunk * chunk
        why.append(f"tiers.disk = {_gib(size)} per rank at {path}: lmcache_max_local_disk_size (unchecked)")
        return DiskTierPlan(True, path, None, size, tokens, odirect, size)
    reserve = disk_reserve_bytes(disk)
    hard = disk.free_bytes // ranks
    fit = max(0, disk.free_bytes - reserve) // ranks
    bound = (f"free {_gib(disk.free_bytes)} on {disk.mount} - reserve {_gib(reserve)} "
             f"(max(5 GiB, 10% of {_gib(disk.total_bytes)})), / {ranks} rank(s)")
    floor_tokens = max(gpu.kv_capacity_tokens, cpu.capacity_tokens if cpu.enabled else 0)
    if ov.disk_size_gib is not None:
        want = gib_floor_bytes(int(ov.disk_size_gib * GIB))
        if want > hard:
            raise PlanError(f"lmcache_max_local_disk_size={ov.disk_size_gib} GiB per rank does not fit: "
                            f"{disk.mount} has {_gib(hard)} free per rank; lower it or unset it")
        if want > fit:
            warn.append(f"lmcache_max_local_disk_size={ov.disk_size_gib} GiB eats into the disk reserve on {disk.mount}")
        tokens = want // bpt_rank // chunk * chunk
        if tokens <= floor_tokens:
            warn.append(f"disk tier ({tokens:,} tokens) is not larger than the tiers above it ({floor_tokens:,})")
        why.append(f"tiers.disk = {_gib(want)} per rank ({tokens:,} tokens) at {path}: lmcache_max_local_disk_size")
        return DiskTierPlan(True, path, disk.mount, want, tokens, odirect, fit)
    size = gib_floor_bytes(fit)
    tokens = size // bpt_rank // chunk * chunk
    if tokens <= floor_tokens:
        warn.append(f"disk tier off: {_gib(size)} per rank on {disk.mount} holds {tokens:,} tokens, not more "
                    f"than the CPU/GPU tiers' {floor_tokens:,}")
        why.append(f"tiers.disk = off: {bound} adds no capacity")
        return DiskTierPlan(False, None, None, 0, 0, False, fit)
    why.append(f"tiers.disk = {_gib(size)} per rank ({tokens:,} tokens) at {path} ({where}): {bound}, "
               f"rounded down to 0.01 GiB; use_odirect={odirect} (probe: {disk.odirect})")
    return DiskTierPlan(True, path, disk.mount, size, tokens, odirect, fit)


def gib_floor_bytes(num_bytes: int) -> int:
    """Round down to 0.01 GiB, as bytes that render back to exactly that 2-decimal GiB figure."""
    hundredths = max(0, num_bytes) * 100 // GIB
    return -(-hundredths * GIB // 100)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes} B"

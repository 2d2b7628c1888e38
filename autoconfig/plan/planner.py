"""The tier planner: (host snapshot, model geometry, serving settings) -> TierPlan.

A pure function, run once at container start (``lmi-cache configure``) or by
``lmi-cache plan`` for what-if questions. Every number it produces carries a
one-line explanation; every estimate says what it assumes.
"""
from __future__ import annotations

import math
from dataclasses import replace

from autoconfig.model.kv import hybrid_group_layers
from autoconfig.probe.snapshot import HostSnapshot
from autoconfig.plan.checks import check_disk_path_on_host, check_parallel_fits_model, check_settings
from autoconfig.plan.disk import mount_of
from autoconfig.plan.hybrid import (
    hybrid_block_tokens, hybrid_chunk_tokens, hybrid_pool_tokens, hybrid_request_bytes, hybrid_vllm_args,
    state_bytes_rank, tier_bytes_per_token,
)
from autoconfig.plan.types import (
    GIB, KIB, CpuTierPlan, GpuPlan, LmiReference, ModelInfoLike, PlanError, PlanModel, TierPlan,
)
from autoconfig.plan.sizing import cpu_tier, disk_tier, gib_floor_bytes  # noqa: F401 (re-exported)
from autoconfig.plan.settings import ServingSettings
from lmi_cache.kv_layout import KvLayout

# vLLM's KV block size: 16 on CUDA by default; the CPU backend (vllm/platforms/cpu.py,
# 0.32) forces 128, except the reference MLA kernel which needs 16.
CUDA_BLOCK_TOKENS = 16
CPU_BLOCK_TOKENS = 128
CPU_MLA_BLOCK_TOKENS = 16

DEFAULT_CHUNK_TOKENS = 256  # LMCache's default, a multiple of every block size above
MIN_CHUNK_BYTES = 256 * KIB  # below this, per-chunk costs (hash, index, syscall) dominate I/O
MAX_CHUNK_TOKENS = 2048  # larger chunks waste the unfilled tail of short prompts
FALLBACK_MAX_MODEL_LEN = 8192  # when neither settings nor config.json give one

# GPU memory vLLM keeps outside the KV cache besides weights: CUDA context and
# NCCL buffers (non-torch memory), the profiling run's peak activations and CUDA
# graphs. vLLM measures this at start-up; we can only estimate it.
ACTIVATION_RESERVE_MIN_BYTES = 1 * GIB
ACTIVATION_RESERVE_FRACTION = 0.05


# lmi_cache.keys.kv_groups caches an MLA latent group (vLLM's MLAAttentionSpec) like full attention; DeepSeek-V3.2's
# indexer keys share one UniformTypeKVCacheSpecs group with the latent, and each chunk carries both.
_INDEXER_CONNECTOR_WARNING = ("sparse MLA model: lmi-cache's connector stores the latent and its indexer keys in "
                              "every chunk (the sizes planned count both); that save and load are tested on CPU "
                              "tensors only, since vLLM's CPU backend runs no sparse attention: check hits on one "
                              "instance (lmi_cache_worker_load_faults stays 0) before relying on them")


def plan_tiers(
    host: HostSnapshot,
    model: PlanModel | ModelInfoLike | KvLayout,
    settings: ServingSettings,
    *,
    cpu_kvcache_space_gib: int | None = None,
) -> TierPlan:
    """Size the GPU (or CPU-backend) KV cache, the CPU tier and the disk tier.

    ``cpu_kvcache_space_gib`` is VLLM_CPU_KVCACHE_SPACE when already set by the
    user (CPU backend only); None lets the planner choose it.
    """
    from autoconfig.plan.blend import plan_blending
    from autoconfig.plan.peer import plan_peer
    from autoconfig.render.lmcache_yaml import lmcache_dict
    from autoconfig.render.vllm_args import vllm_args

    m = PlanModel.coerce(model)
    check_settings(settings)
    check_parallel_fits_model(m, settings, num_gpus=len(host.gpus))
    if settings.overrides.disk_path is not None:
        check_disk_path_on_host(settings.overrides.disk_path, host)
    why: list[str] = []
    warn: list[str] = []
    tp, pp = settings.tp, settings.pp
    bpt = m.layout.kv_bytes_per_token
    bpt_rank = m.layout.kv_bytes_per_token_per_rank(tp, pp)
    why.append(f"kv_bytes_per_token = {bpt:,}: {_layout_text(m.layout)}")
    why.append(f"kv_bytes_per_token_per_rank = {bpt_rank:,}: {_rank_text(m.layout, tp, pp)}")
    why += [f"model: {note}" for note in m.notes]
    if m.layout.is_mla and m.layout.side_caches and settings.engine == "lmi_cache":
        warn.append(_INDEXER_CONNECTOR_WARNING)
    max_model_len = settings.max_model_len or m.max_position_embeddings or FALLBACK_MAX_MODEL_LEN
    if not settings.max_model_len and not m.max_position_embeddings:
        warn.append(f"max_model_len unknown: assuming {FALLBACK_MAX_MODEL_LEN}; set option.max_model_len")

    ranks = _ranks_per_host(host, settings, why, warn)
    gpu = _gpu_plan(host, m, settings, bpt_rank, ranks, max_model_len, cpu_kvcache_space_gib, why, warn)
    chunk = _chunk_size(settings, bpt_rank, gpu.block_size, max_model_len, why,
                        state_bytes_rank(m, tp, pp) if m.state else 0)
    tier_bpt = tier_bytes_per_token(m, tp, pp, bpt_rank, chunk, why)
    cpu = _with_session_retention(cpu_tier(host, m, settings, gpu, tier_bpt, ranks, chunk, why, warn, max_model_len),
                                  settings, tier_bpt, chunk, why, warn)
    disk = disk_tier(host, settings, gpu, cpu, tier_bpt, ranks, chunk, why, warn)
    ref = lmi_reference(host, m.weights_bytes, tp)
    why.append(
        f"LMI formula for comparison: (available RAM - max(2 x weights, 20%)) / tp = "
        f"{ref.cpu_gib_per_rank} GiB CPU per rank; (/tmp total - max(2 x weights, 20%)) / tp = "
        f"{_opt(ref.disk_gib_per_rank)} GiB disk per rank (ignores cgroup, GPU, DP, free space, disk type)"
    )
    remote_url = settings.overrides.remote_url
    if remote_url:
        why.append(_remote_text(remote_url, bpt_rank * chunk, settings.engine))
    blend = plan_blending(m, settings, why, warn)
    peer = plan_peer(settings, host.rdma_drivers, why, warn)
    plan = TierPlan(
        remote_url=remote_url, peer=peer,
        model_name=m.name, kv_dtype=m.layout.kv_dtype, kv_bytes_per_token=bpt,
        kv_bytes_per_token_per_rank=bpt_rank, weights_bytes=m.weights_bytes,
        max_model_len=max_model_len, tp=tp, pp=pp, dp=settings.dp, ranks_per_host=ranks,
        gpu=gpu, cpu=cpu, disk=disk, chunk_size=chunk, lmi_reference=ref, engine=settings.engine,
        env=_server_env(gpu, settings, why),
        warnings=warn, explanation=why, blend=blend,
    )
    args = vllm_args(plan, settings) + hybrid_vllm_args(m, gpu.backend, gpu.block_size, chunk, why)
    return replace(plan, lmcache_config=lmcache_dict(plan), vllm_args=args)


def _with_session_retention(cpu: CpuTierPlan, s: ServingSettings, bpt_rank: int, chunk: int, why: list[str],
                            warn: list[str]) -> CpuTierPlan:
    """The CPU tier with its share for open stateful sessions (lmi_cache only; LMCache has no such policy)."""
    from lmi_cache.eviction.retaining import DEFAULT_RETENTION_SHARE

    asked = s.overrides.session_retention_share
    if s.engine != "lmi_cache":
        if asked:
            warn.append(f"lmcache_session_retention_share={asked} ignored: upstream LMCache has no session retention")
        return cpu
    if not cpu.enabled:
        return cpu
    if asked == 0:
        why.append("session_retention_share = 0: lmcache_session_retention_share (open sessions get no preference)")
        return cpu
    share = DEFAULT_RETENTION_SHARE if asked is None else asked
    source = "the default" if asked is None else "lmcache_session_retention_share"
    planned = replace(cpu, session_retention_share=share)
    num_bytes = planned.session_retention_bytes_per_rank
    why.append(
        f"session_retention_share = {share} ({source}; extra_config): while a stateful session is open, "
        f"its conversation's chunks are evicted after all others, up to {num_bytes / GIB:,.2f} GiB per rank "
        f"({num_bytes // bpt_rank // chunk * chunk:,} tokens); released when the session closes or expires; beyond "
        f"that, chunks are evicted in plain cache_policy order (0 turns retention off)")
    return planned


def _remote_text(url: str, chunk_bytes: int, engine: str) -> str:
    from lmi_cache.remote.url import parse_remote_url

    remote = parse_remote_url(url)
    return (f"remote tier = {remote.store_kind()} store {remote.redacted} (option.lmcache_remote_url), shared by every server and "
            f"rank of the fleet: each chunk is {chunk_bytes / 2**20:,.1f} MiB per rank (kv_bytes_per_token_per_rank "
            f"x chunk_size; {chunk_bytes * 8 / 10e9 * 1e3:,.0f} ms to move at 10 Gb/s, {chunk_bytes * 8 / 100e9 * 1e3:,.1f} ms "
            f"at 100 Gb/s); every stored chunk is also queued for it (never waited for), and a chunk no local tier "
            f"holds is looked up there (lookup_timeout_ms, default 50) and loaded into the CPU tier. Its size is the "
            f"store's own (Redis maxmemory with allkeys-lru, or an S3 lifecycle rule), not planned here"
            + ("" if engine == "lmi_cache" else "; upstream LMCache reads remote_url with its own remote backends"))


def _server_env(gpu: GpuPlan, s: ServingSettings, why: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    if gpu.backend == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(gpu.cpu_kvcache_space_gib)
    if s.engine == "lmcache":
        # Upstream LMCache's default 'builtin' chunk hash is Python's hash(): without a
        # fixed seed, every process (and restart) computes different keys for the same tokens.
        env["PYTHONHASHSEED"] = "0"
        why.append("env PYTHONHASHSEED=0: upstream LMCache hashes chunks with Python's hash()")
    if s.engine == "lmi_cache" and s.overrides.remote_url:
        # A batched remote GET holds a whole step's values at once; with glibc's defaults each one is a
        # fresh mmap that is faulted in and returned to the kernel per batch (measured: batched loads
        # at 0.55x a GET loop for 4 MiB values, 1.00x with these settings; README, fleet tier).
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 << 20)
        env["MALLOC_TRIM_THRESHOLD_"] = str(256 << 20)
        why.append("env MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456: batched remote loads "
                   "reuse freed memory instead of faulting in fresh pages per batch (keeps up to 256 MiB free)")
    return env


def _ranks_per_host(host: HostSnapshot, s: ServingSettings, why: list[str], warn: list[str]) -> int:
    model_ranks = s.tp * s.pp
    if not host.gpus:
        why.append(f"ranks_per_host = {s.ranks_per_host}: tp {s.tp} x pp {s.pp} x dp {s.dp} CPU workers")
        return s.ranks_per_host
    num_gpus = len(host.gpus)
    if model_ranks > num_gpus:
        raise PlanError(
            f"tensor_parallel_degree={s.tp} x pipeline_parallel_degree={s.pp} needs {model_ranks} GPUs "
            f"but this host has {num_gpus}: lower tensor_parallel_degree (multi-node serving is out of scope)"
        )
    if s.ranks_per_host > num_gpus:
        # vLLM would start the replicas that fit and fail on the next one: refuse it here, one line.
        raise PlanError(
            f"data_parallel_degree={s.dp} replicas x tensor_parallel_degree={s.tp} x pipeline_parallel_degree={s.pp} "
            f"need {s.ranks_per_host} GPUs but this host has {num_gpus}: lower data_parallel_degree to "
            f"{num_gpus // model_ranks} or less"
        )
    replicas = s.dp
    ranks = replicas * model_ranks
    why.append(f"ranks_per_host = {ranks}: tp {s.tp} x pp {s.pp} x {replicas} DP replica(s) on {num_gpus} GPU(s)")
    return ranks


def _gpu_plan(host: HostSnapshot, m: PlanModel, s: ServingSettings, bpt_rank: int, ranks: int,
              max_model_len: int, cpu_space_gib: int | None, why: list[str], warn: list[str]) -> GpuPlan:
    weights_rank = math.ceil(m.weights_bytes / (s.tp * s.pp))
    if not host.gpus:
        return _cpu_backend_plan(host, m, bpt_rank, ranks, max_model_len, cpu_space_gib, why, warn)
    used = sorted(host.gpus, key=lambda g: g.index)[:ranks]
    total = min(g.memory_total_bytes for g in used)
    budget = int(total * s.gpu_memory_utilization)
    reserve = max(ACTIVATION_RESERVE_MIN_BYTES, int(total * ACTIVATION_RESERVE_FRACTION))
    kv_bytes = budget - weights_rank - reserve
    if kv_bytes < bpt_rank * CUDA_BLOCK_TOKENS:
        raise PlanError(
            f"weights {_gib(weights_rank)} per GPU (tensor_parallel_degree={s.tp}) + reserve {_gib(reserve)} "
            f"leave no KV cache in {_gib(budget)} (gpu_memory_utilization={s.gpu_memory_utilization}): "
            "raise tensor_parallel_degree or gpu_memory_utilization"
        )
    tokens, block, per = _pool_tokens(m, s.tp, kv_bytes, bpt_rank, CUDA_BLOCK_TOKENS, max_model_len, why)
    why.append(
        f"gpu.kv_capacity_tokens = {tokens:,} per rank: {_gib(total)} x {s.gpu_memory_utilization} - weights "
        f"{_gib(weights_rank)} (1/{s.tp * s.pp}) - reserve {_gib(reserve)} (estimate: max(1 GiB, 5%) for "
        f"CUDA context, activations, CUDA graphs; vLLM measures it) = {_gib(kv_bytes)}{per}"
    )
    for g in used:
        if g.memory_free_bytes < budget:
            warn.append(f"GPU {g.index} has {_gib(g.memory_free_bytes)} free, less than gpu_memory_utilization "
                        f"x total = {_gib(budget)}: vLLM will refuse to start; free the GPU or lower it")
            break
    if tokens < max_model_len:
        raise PlanError(f"max_model_len={max_model_len}: the GPU KV cache holds about {tokens:,} tokens per rank "
                        f"(estimated: {_gib(kv_bytes)} after weights and reserve), less than one sequence, so vLLM would refuse to "
                        f"start; set max_model_len to {tokens} or less, or raise tensor_parallel_degree or "
                        "gpu_memory_utilization")
    return GpuPlan("cuda", len(host.gpus), kv_bytes, tokens, block, None)


def _pool_tokens(m: PlanModel, tp: int, kv_bytes: int, bpt_rank: int, base_block: int, max_model_len: int,
                 why: list[str]) -> tuple[int, int, str]:
    """(tokens the KV pool holds per rank, vLLM's block size, how the division reads in the explanation)."""
    if m.state is not None:
        block = hybrid_block_tokens(m, tp, base_block)
        return hybrid_pool_tokens(m, tp, kv_bytes, block, max_model_len, why), block, " (hybrid pool above)"
    pool_bpt = _pool_bytes_per_token(m, bpt_rank, why)
    return kv_bytes // pool_bpt // base_block * base_block, base_block, f" / {pool_bpt:,} B"


def _pool_bytes_per_token(m: PlanModel, bpt_rank: int, why: list[str]) -> int:
    """Bytes one token slot of vLLM's block pool costs per rank: with windowed and full layers, a group's worth.

    vLLM's hybrid KV cache manager (on with lmi-cache) splits the layers into groups of equal size that share
    one pool; a token of a long request takes a slot in the full-attention group, and each windowed group holds
    only about one window per request. So the pool counts tokens of ``group`` layers, not of every layer.
    """
    layers = m.layout.num_layers
    group = hybrid_group_layers(layers, m.num_sliding_layers)
    if group == layers:
        return bpt_rank
    pool_bpt = math.ceil(bpt_rank * group / layers)
    why.append(
        f"pool bytes per token = {pool_bpt:,} per rank: {m.num_sliding_layers} of {layers} layers look back "
        f"{m.sliding_window:,} tokens; vLLM's hybrid KV cache manager groups layers {group} at a time "
        f"({bpt_rank:,} B x {group}/{layers}); every request also keeps about one window in each windowed group"
    )
    return pool_bpt


def _cpu_backend_plan(host: HostSnapshot, m: PlanModel, bpt_rank: int, ranks: int, max_model_len: int,
                      space_gib: int | None, why: list[str], warn: list[str]) -> GpuPlan:
    block = CPU_MLA_BLOCK_TOKENS if m.layout.is_mla else CPU_BLOCK_TOKENS
    if space_gib is not None:
        how = "VLLM_CPU_KVCACHE_SPACE set by the user"
    else:
        # Left unset, vLLM 0.32 takes total RAM x gpu_memory_utilization - RSS per worker,
        # starving the CPU tier (and failing on NUMA hosts): we set it to what one
        # full-length sequence needs, at least 1 GiB.
        space_gib = max(1, math.ceil(_sequence_bytes(m, bpt_rank, block, max_model_len) / GIB))
        how = f"chosen: one max_model_len ({max_model_len:,}) sequence, at least 1 GiB; sets VLLM_CPU_KVCACHE_SPACE"
    kv_bytes = space_gib * GIB
    tokens, block, per = _pool_tokens(m, 1, kv_bytes, bpt_rank, block, max_model_len, why)
    why.append(f"gpu.kv_capacity_tokens = {tokens:,} per rank: no GPU, vLLM's CPU backend keeps its KV "
               f"cache in RAM: {space_gib} GiB ({how}){per}")
    if tokens < max_model_len:
        raise PlanError(f"max_model_len={max_model_len}: VLLM_CPU_KVCACHE_SPACE={space_gib} holds {tokens:,} tokens, "
                        f"less than one sequence, so vLLM would refuse to start; set max_model_len to {tokens} or "
                        f"less, or VLLM_CPU_KVCACHE_SPACE to "
                        f"{math.ceil(_sequence_bytes(m, bpt_rank, block, max_model_len) / GIB)}")
    return GpuPlan("cpu", 0, kv_bytes, tokens, block, space_gib)


def _sequence_bytes(m: PlanModel, bpt_rank: int, block: int, max_model_len: int) -> int:
    """Pool bytes one max_model_len sequence needs (CPU backend: one rank, tp 1)."""
    if m.state is not None:
        return hybrid_request_bytes(m, 1, hybrid_block_tokens(m, 1, block), max_model_len)
    return max_model_len * bpt_rank


def _chunk_size(s: ServingSettings, bpt_rank: int, block: int, max_model_len: int,
                why: list[str], state_bytes: int = 0) -> int:
    """Tokens per stored chunk; ``state_bytes``: a hybrid model's state per chunk boundary per rank (0: none)."""
    override = s.overrides.chunk_size
    if override is not None:
        if override <= 0 or override % block:
            raise PlanError(f"lmcache_chunk_size={override}: must be a positive multiple of vLLM's "
                            f"block size {block} on this backend")
        why.append(f"chunk_size = {override}: set by lmcache_chunk_size")
        return override
    chunk = DEFAULT_CHUNK_TOKENS
    reason = f"LMCache's default; {_size(chunk * bpt_rank)} per chunk per rank is large enough to amortise I/O"
    if state_bytes:
        chunk, reason = hybrid_chunk_tokens(block, bpt_rank, state_bytes, DEFAULT_CHUNK_TOKENS, MAX_CHUNK_TOKENS)
    while chunk * bpt_rank < MIN_CHUNK_BYTES and chunk * 2 <= MAX_CHUNK_TOKENS:
        chunk *= 2
        reason = (f"doubled from 256 so one chunk is >= 256 KiB per rank "
                  f"({chunk * bpt_rank:,} B): small chunks make per-chunk costs dominate")
    if chunk > max_model_len:
        chunk = max(block, max_model_len // block * block)
        reason = f"max_model_len {max_model_len} is shorter than a chunk; largest block multiple that fits"
    why.append(f"chunk_size = {chunk} tokens: {reason} (multiple of block size {block})")
    return chunk


def lmi_reference(host: HostSnapshot, weights_bytes: int, tp: int) -> LmiReference:
    """AWS LMI's formula: (available - max(2 x weights, 20%)) / tp, in whole GiB (it writes int())."""
    weights_gib = weights_bytes / GIB
    avail_gib = host.memory.available_bytes / GIB
    cpu = max(0.0, avail_gib - max(2 * weights_gib, 0.2 * avail_gib)) / tp
    tmp = mount_of(host, "/tmp")
    disk: int | None = None
    if tmp is not None:
        total_gib = tmp.total_bytes / GIB  # LMI reads the TOTAL size of /tmp, not the free space
        disk = int(max(0.0, total_gib - max(2 * weights_gib, 0.2 * total_gib)) / tp)
    return LmiReference(cpu_gib_per_rank=int(cpu), disk_gib_per_rank=disk)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", KIB)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes} B"


def _opt(value: int | None) -> str:
    return "n/a (no /tmp)" if value is None else str(value)


def _layout_text(lay: KvLayout) -> str:
    if lay.is_mla:
        text = f"{lay.num_layers} layers x latent {lay.head_dim} x {lay.dtype_bytes} B ({lay.kv_dtype}, MLA)"
    else:
        text = (f"{lay.num_layers} layers x 2 (K,V) x {lay.num_kv_heads} KV heads x head_dim {lay.head_dim} "
                f"x {lay.dtype_bytes} B ({lay.kv_dtype})")
    for side in lay.side_caches:
        text += f" + {side.num_layers} layers x {side.bytes_per_token_per_layer} B ({side.name})"
    return text


def _rank_text(lay: KvLayout, tp: int, pp: int) -> str:
    layers = f"{lay.layers_per_rank(pp)} layers (ceil({lay.num_layers}/pp {pp}))"
    sides = "".join(f"; {side.name} {side.bytes_per_token_per_rank(pp):,} B, replicated on every TP rank"
                    for side in lay.side_caches)
    if lay.is_mla:
        return f"{layers}; MLA latent replicated on each of the {tp} TP rank(s){sides}"
    return f"{layers} x {lay.kv_heads_per_rank(tp)} KV head(s) (max(1, {lay.num_kv_heads}//tp {tp})){sides}"

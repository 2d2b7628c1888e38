"""What the connector reads at start: vLLM's config (dtype, parallelism, weights) and the LMCache config.

Runs in the vLLM scheduler and worker processes, once, when vLLM builds the
connector. A chunk size vLLM's paged cache cannot hold is refused here with one
line naming the setting, and so is a model whose sparse-attention indexer keys
sit in a KV cache group other than the one vLLM builds for DeepSeek-V3.2 (its
latents and indexer keys together, cached like MLA latent groups of DeepSeek
V2/V3, Kimi K2, Mistral Large 3: ``lmi_cache.keys.kv_groups``). vLLM's KV cache
groups become ours here (``kv_groups``), refused with one line where the
connector cannot cache them.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from lmi_cache.errors import ConfigError
from lmi_cache.keys.kv_groups import KvCacheGroup, UnsupportedKvGroups, is_indexer, kv_groups_of, latent_with_indexer

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def kv_dtype_name(vllm_config: VllmConfig) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype == "auto":
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    return cache_dtype


def parallel_sizes(vllm_config: VllmConfig) -> tuple[int, int]:
    parallel = vllm_config.parallel_config
    return int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)


def dp_index(vllm_config: VllmConfig) -> int:
    """This engine's data-parallel replica (vLLM's ``engine`` label); 0 without data parallelism."""
    parallel = vllm_config.parallel_config
    return int(getattr(parallel, "data_parallel_index", None) or getattr(parallel, "data_parallel_rank", 0) or 0)


def dp_size(vllm_config: VllmConfig) -> int:
    """How many data-parallel replicas share this host's disk (1 without data parallelism)."""
    return max(1, int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1))


def weights_identity(vllm_config: VllmConfig) -> str:
    from lmi_cache.keys.model_identity import served_model_identity

    started = time.perf_counter()
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    identity = served_model_identity(vllm_config.model_config, download_dir)
    logger.info("lmi-cache: model identity %s (%.3f s)", identity, time.perf_counter() - started)
    return identity


def drafter_identity(vllm_config: VllmConfig) -> str:
    """What the keys add for a speculative drafter with KV layers of its own; "" without one.

    An EAGLE-family drafter's attention layers share the target's KV cache group, so every chunk carries
    their KV: which drafter (method and weights) made it is part of what the chunk holds. N-gram and
    suffix drafting have no layers and leave the keys as they are.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not (spec.use_eagle() or spec.uses_draft_model()):
        return ""
    from lmi_cache.keys.model_identity import served_model_identity

    draft = spec.draft_model_config
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    identity = served_model_identity(draft, download_dir) if draft is not None else ""
    return f"|drafter={spec.method}:{spec.num_speculative_tokens}:{identity}"


def drafter_planning(vllm_config: VllmConfig, block_size: int) -> tuple[int, int]:
    """``SchedulerGeometry``'s drafter fields, mirroring vLLM's own prefix cache for the same settings.

    ``(drafter_backoff_tokens, unfinal_tail_tokens)``: one block when vLLM drops an EAGLE-family drafter's last cached block
    (``SpeculativeConfig.use_eagle_block_drop``); ``unfinal_tail_tokens``: vLLM's re-prefillable tail
    (``num_prefill_lookahead_tokens - 1``, non-zero for multi-module MTP only).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    backoff = block_size if spec is not None and spec.use_eagle_block_drop() else 0
    tail = max(0, int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0) - 1)
    return backoff, tail


def load_cache_config() -> Any:
    from lmi_cache.config.cache_config import load_config

    config, warnings = load_config()
    for warning in warnings:
        logger.warning("lmi-cache: %s", warning)
    for key in ("save_unfull_chunk", "save_decode_cache"):
        if getattr(config, key):
            # The engine stores partial chunks, but vLLM's paged cache only hands
            # over whole blocks: the connector saves full prompt chunks only.
            logger.warning("lmi-cache: %s is set but the vLLM connector saves full prompt chunks only; "
                           "it has no effect here", key)
    return config


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    if chunk_size <= 0 or chunk_size % block_size:
        raise ConfigError(
            f"chunk_size: {chunk_size} is not a multiple of vLLM's block size {block_size}; "
            f"set chunk_size (LMCACHE_CHUNK_SIZE) to a multiple of {block_size}"
        )


def refuse_indexer_caches(kv_cache_config: Any) -> None:
    """One line naming the layers of a group holding DeepSeek-V3.2's indexer keys in a shape not cached.

    DeepSeek-V3.2 adds an indexer K cache per layer (``DeepseekV32IndexerCache``: an ``MLAAttentionSpec`` with
    ``cache_role`` indexer, uint8) and ``get_kv_cache_groups`` puts it in one ``UniformTypeKVCacheSpecs`` group
    with the latent. That group is cached (latent and indexer blocks in each chunk, ``kv_groups``); indexer keys
    in any other grouping (alone, or beside other kinds of layers) are refused here rather than stored in part.
    """
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        members = getattr(spec, "kv_cache_specs", None) or {name: spec for name in group.layer_names}
        names = [name for name, member in members.items() if is_indexer(member)]
        if not names or latent_with_indexer(spec):
            continue
        raise ConfigError(
            f"KV cache group {index} ({type(spec).__name__}) holds {len(names)} sparse-attention indexer key layers "
            f"({names[0]}..) and {len(members) - len(names)} other layers (not MLA latents only): lmi-cache's "
            "connector stores indexer keys only in one group with the MLA latents of their model; serve this model "
            "without KV offloading (option.lmcache_auto_config=false, no --kv-transfer-config)"
        )


def kv_groups(kv_cache_config: Any) -> tuple[KvCacheGroup, ...]:
    refuse_indexer_caches(kv_cache_config)  # named for what it is, before the generic refusal below
    try:
        return kv_groups_of(kv_cache_config)
    except UnsupportedKvGroups as err:
        raise ConfigError(f"{err}; serve this model without the lmi-cache connector") from None


def warn_on_sparse_state_retention(groups: tuple[KvCacheGroup, ...], kv_cache_config: Any, chunk: int) -> None:
    """A state group caches the boundaries vLLM retains; say so when not every chunk boundary is one of them.

    Hybrid state-space models (Mamba / linear-attention layers next to attention) are served with prefix
    caching in vLLM's "align" mode: the connector stores the state vLLM offers at each chunk boundary next to
    the attention chunks. vLLM offers a boundary's state only if it retains it, so
    ``--prefix-cache-retention-interval`` should divide the chunk size; this warns at start when it does not
    (fewer boundaries are cached, never wrong ones). Without prefix caching there are no boundary states:
    refused.
    """
    interval = getattr(kv_cache_config, "prefix_cache_retention_interval", 0)
    if any(g.is_state for g in groups) and interval is not None and (interval <= 0 or chunk % interval):
        logger.warning("lmi-cache: vLLM retains Mamba states every %s tokens, so not every %d-token chunk boundary "
                       "can be cached; pass --prefix-cache-retention-interval %d for hits at every chunk",
                       interval or "(prompt end only)", chunk, chunk)

"""What the connector reads at start: vLLM's config (dtype, parallelism, weights) and the LMCache config.

Runs in the vLLM scheduler and worker processes, once, when vLLM builds the
connector. A chunk size vLLM's paged cache cannot hold is refused here with one
line naming the setting.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from lmi_cache.errors import ConfigError

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

"""Blending as a part of ``LmiCacheConnector``: CacheBlend-style reuse of cached segments (vLLM scheduler and workers).

The connector composes one :class:`ConnectorBlending` when ``enable_blending``
is on (LMCache YAML or ``LMCACHE_ENABLE_BLENDING``) and hands it a
:class:`BlendContext`: the settings, vLLM's config, the connector's key space
and the block size. It never reads the connector's private state; the
connector calls it from its hooks and passes what a hook needs (the prefix
path's answer, the worker side).

Scheduler side, per request with blendable segments (``scheduler_plan``):

* the exact prefix wins: the prefix path (vLLM's own hit plus the chunks the
  chunk cache holds) is asked first, and the blend starts where it ends, so a
  prompt whose prefix chunks are cached is served exactly and only segments
  after them are blended (``BlendScheduler.plan``);
* a blended request saves no exact chunk (``SchedulerSide`` is told
  ``saves=False``), and its blocks from the end of the exact prefix on get
  block hashes no other request computes (:func:`isolate_blocks`), so vLLM's
  own prefix cache never serves blended KV as exact. The blocks are re-hashed
  rather than re-salted: vLLM chains every block hash from the previous one,
  so changing the hashes from the first blended block on is enough, the
  request's own ``cache_salt`` (tenant isolation) stays as the client sent it,
  and the blocks of its exact prefix keep their real hashes. If vLLM asks
  about the request again before admitting it, the real hashes come back first.

Worker side: the prefix path's chunk loads run first (``WorkerSide.load``),
then each blend reads that exact prefix from the request's blocks, loads its
cached segments from the engine and writes the blended KV
(``worker_jobs.BlendWorker``); segments no worker holds are computed alone and
stored after the step. A blend whose request had a chunk load fault is given
back to vLLM to recompute, like every other blend fault.
"""
from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmi_cache.blend.jobs import BlendConnectorMetadata, attention_key, attention_payload_bytes
from lmi_cache.blend.scheduler_plan import BlendScheduler, KeySpaceFactory
from lmi_cache.blend.settings import BlendConfigError, BlendSettings
from lmi_cache.metrics.scheduler_series import BlendSchedulerMetrics
from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.placement.messages import TierEvent
from lmi_cache.transfer.layouts import LayoutDescriptor
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from lmi_cache.blend.worker_jobs import BlendWorker
    from lmi_cache.metrics.scheduler_series import SchedulerMetrics
    from lmi_cache.vllm_connector.worker_side import WorkerSide

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlendContext:
    """What the connector shares with its blending component."""

    settings: BlendSettings
    vllm_config: VllmConfig
    key_space: KeySpaceFactory  # the connector's key space for a KV layout tag (segments use its variant)
    block_size_tokens: int
    scheduler_metrics: SchedulerMetrics | None = None  # the scheduler's registry; None on workers
    directory: PlacementDirectory | None = None  # the scheduler's placement directory; None on workers


def hf_config(vllm_config: VllmConfig) -> dict[str, Any]:
    return vllm_config.model_config.hf_config.to_dict()


def check_model(settings: BlendSettings, vllm_config: VllmConfig) -> None:
    """Refuse a model blending does not cover before anything else starts (one line, no traceback)."""
    from lmi_cache.blend.support import check_blendable

    name = str(vllm_config.model_config.model)
    check_blendable(hf_config(vllm_config), name)
    settings.check_model(int(vllm_config.model_config.hf_config.num_hidden_layers), name)


def isolate_blocks(request: Request, first_block: int) -> None:
    """Give blocks ``first_block``.. of ``request`` hashes no other request computes (a fresh nonce each time)."""
    nonce = uuid.uuid4().bytes
    hashes = request.block_hashes
    hashes[first_block:] = [hashlib.blake2b(nonce + bytes(h), digest_size=min(len(h), 64)).digest()  # type: ignore[misc]
                            for h in hashes[first_block:]]


def restore_blocks(request: Request, first_block: int) -> None:
    """Recompute the real hashes of blocks ``first_block``.. (undoes :func:`isolate_blocks`)."""
    del request.block_hashes[first_block:]
    request.update_block_hashes()


def _separator_ids(vllm_config: VllmConfig, special_str: str) -> tuple[int, ...]:
    from transformers import AutoTokenizer

    from lmi_cache.blend.segments import separator_ids

    model_config = vllm_config.model_config
    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer, revision=getattr(model_config, "tokenizer_revision", None),
        trust_remote_code=bool(getattr(model_config, "trust_remote_code", False)),
    )
    return separator_ids(lambda text: tokenizer.encode(text, add_special_tokens=False), special_str)


def _layer0_bytes_per_token(vllm_config: VllmConfig) -> int:
    """Each rank's bytes per token of a segment's layer-0 attention object, or 0 where the workers cannot reuse one
    (``layer0_reuse`` needs float32 KV stored as is: ``CpuPagedAttention.native_scattered``)."""
    import torch

    model_config = vllm_config.model_config
    if model_config.dtype != torch.float32 or vllm_config.cache_config.cache_dtype != "auto":
        return 0
    heads = model_config.get_num_attention_heads(vllm_config.parallel_config)
    return attention_payload_bytes(1, heads, model_config.get_head_size())


def _layer_index(name: str) -> int:
    """``model.layers.7.self_attn.attn`` -> 7 (registration order is not promised to be layer order)."""
    parts = name.split(".")
    for before, part in zip(parts, parts[1:]):
        if before == "layers" and part.isdigit():
            return int(part)
    raise BlendConfigError(f"enable_blending: cannot tell the layer of KV cache {name!r}; turn blending off")


class ConnectorBlending:
    """One process's blending: the scheduler half or the worker half, by ``scheduler``."""

    def __init__(self, context: BlendContext, scheduler: bool) -> None:
        self.context = context
        self.scheduler: BlendScheduler | None = None
        self.worker: BlendWorker | None = None
        self.model_source = ""  # worker: "plugin" or "search" (how the model was reached)
        self._isolated: dict[str, int] = {}  # req id -> first block re-hashed by isolate_blocks
        self._failed_blocks: set[int] = set()
        if scheduler:
            settings = context.settings
            sep = _separator_ids(context.vllm_config, settings.special_str)
            assert context.directory is not None, "the scheduler's blending needs the placement directory"
            self.scheduler = BlendScheduler(settings, sep, context.key_space, context.directory,
                                            self._scheduler_metrics(), _layer0_bytes_per_token(context.vllm_config))
            logger.info("lmi-cache: blending on (separator %r = token ids %s, check layers %s, ratios %s)",
                        settings.special_str, list(sep), list(settings.check_layers), list(settings.recompute_ratios))

    def _scheduler_metrics(self) -> BlendSchedulerMetrics | None:
        """lmi_cache_blend_* series beside the scheduler's lmi_cache_* ones (same registry, same ``engine``)."""
        base = self.context.scheduler_metrics
        return None if base is None else BlendSchedulerMetrics(base.registry, base.engine_label)

    # -- scheduler hooks -----------------------------------------------------------------

    def matched_tokens(self, request: Request, num_computed_tokens: int, prefix_tokens: int,
                       layout_tag: str | None) -> int:
        """External tokens for ``request``: the prefix path's ``prefix_tokens``, or more with a blend."""
        assert self.scheduler is not None
        first = self._isolated.pop(request.request_id, None)
        if first is not None:
            restore_blocks(request, first)  # asked again (no memory last time): start from the real hashes
        if layout_tag is None:
            return prefix_tokens
        try:
            tokens = self.scheduler.plan(request, num_computed_tokens, num_computed_tokens + prefix_tokens, layout_tag)
        except Exception as err:  # noqa: BLE001 - a planning fault is the prefix path
            logger.warning("lmi-cache: blend planning failed for request %s (%r)", request.request_id, err)
            return prefix_tokens
        if tokens is None:
            return prefix_tokens
        first = (num_computed_tokens + prefix_tokens) // self.context.block_size_tokens
        isolate_blocks(request, first)
        self._isolated[request.request_id] = first
        return tokens

    def after_alloc(self, request: Request, num_external_tokens: int) -> int | None:
        """The prefix path's share of ``num_external_tokens`` when the request is blended; None when it is not."""
        assert self.scheduler is not None
        share = self.scheduler.confirm(request.request_id, num_external_tokens)
        if share is None:
            first = self._isolated.pop(request.request_id, None)
            if first is not None:
                restore_blocks(request, first)  # not blended after all: its blocks are exact
        return share

    def add_jobs(self, meta: LmiConnectorMetadata, scheduler_output: SchedulerOutput) -> BlendConnectorMetadata:
        assert self.scheduler is not None
        out = BlendConnectorMetadata(loads=meta.loads, saves=meta.saves, async_loads=meta.async_loads)
        self.scheduler.take_jobs(scheduler_output, out)
        return out

    def finished(self, req_id: str) -> None:
        self._isolated.pop(req_id, None)
        if self.scheduler is not None:
            self.scheduler.finished(req_id)

    # -- worker hooks --------------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, torch.Tensor], layout: LayoutDescriptor, rank_index: int) -> None:
        """Reach the loaded model and build this rank's blend worker over its paged KV."""
        from lmi_cache.blend.paged_kv import PagedKV
        from lmi_cache.blend.worker_jobs import BlendWorker
        from lmi_cache.vllm_connector import plugin
        from lmi_cache.vllm_connector.blend_model import VllmLayerwiseModel, find_model

        vllm_config = self.context.vllm_config
        names = sorted(kv_caches, key=_layer_index)
        static = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
        self.model_source = "plugin" if plugin.loaded_model() is not None else "search"
        model = find_model(static.get(names[0]))
        if model is None:
            raise BlendConfigError(
                "enable_blending: the connector cannot reach the model; install lmi-cache so that its vLLM plugin "
                "(entry point vllm.general_plugins: lmi_cache_blend) loads, or turn blending off"
            )
        layerwise = VllmLayerwiseModel(model, hf_config(vllm_config), str(vllm_config.model_config.model))
        block_size = self.context.block_size_tokens
        paged = PagedKV([kv_caches[n] for n in names], layout, block_size)
        paged_attention = None
        if layout.kind == "cpu":
            from lmi_cache.blend.host_heap import blend_heap_bytes, keep_large_allocations_in_heap, prewarm_heap
            from lmi_cache.vllm_connector.cpu_paged_attention import CpuPagedAttention

            first_attn = model.model.layers[0].self_attn
            # Host tensors: the blend's big temporaries come from touched heap, reused across blends.
            if keep_large_allocations_in_heap():
                prewarm_heap(blend_heap_bytes(layerwise.num_layers, int(first_attn.num_kv_heads), layerwise.head_dim,
                                              int(vllm_config.model_config.max_model_len)))
            paged_attention = CpuPagedAttention(
                [kv_caches[n] for n in names], [static.get(n) for n in names], block_size,
                int(first_attn.num_heads), int(first_attn.num_kv_heads), layerwise.head_dim, layerwise.attn_scale,
            )
        self.worker = BlendWorker(self.context.settings, layerwise, paged, rank_index, paged_attention)

    def run_blends(self, meta: object, side: WorkerSide) -> None:
        """Blend this step's jobs (after the prefix path's loads); a request whose chunk load failed is recomputed."""
        if self.worker is None or side.engine is None or not isinstance(meta, BlendConnectorMetadata) or not meta.blends:
            return
        jobs = []
        block = self.worker.paged.block_size
        for job in meta.blends:
            if side.load_failed(job.req_id):
                # Its exact prefix is not in its blocks: vLLM recomputes from the failed chunk on.
                self._failed_blocks.update(job.block_ids[job.prefix_tokens // block : -(-job.end // block)])
            else:
                jobs.append(job)
        # Every promotion the directory planned is answered to it: stored, or failed (a skipped job's too).
        rank = side.rank_index
        side.expect_stores([TierEvent(p.promote_to, p.keys[rank].digest) for job in meta.blends for p in job.pieces
                            if p.keys is not None and p.promote_to]
                           + [TierEvent(p.attention_promote_to, attention_key(p.keys[rank]).digest)
                              for job in meta.blends for p in job.pieces if p.keys is not None and p.attention_promote_to])
        self._failed_blocks |= self.worker.run_blends(jobs, side.engine)

    def run_stores(self, meta: object, side: WorkerSide) -> None:
        if self.worker is None or side.engine is None or not isinstance(meta, BlendConnectorMetadata) \
                or not meta.segment_stores:
            return
        # Every segment store is answered to the directory: stored, or failed.
        rank = side.rank_index
        side.expect_stores([TierEvent(tier, store.keys[rank].digest) for store in meta.segment_stores
                            for tier in store.tiers]
                           + [TierEvent(tier, attention_key(store.keys[rank]).digest) for store in meta.segment_stores
                              for tier in store.attention_tiers])
        self.worker.run_stores(meta.segment_stores, side.engine)

    def take_failed_block_ids(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

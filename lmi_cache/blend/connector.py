"""LmiBlendConnector: the base KV connector plus CacheBlend-style blending (vLLM scheduler and worker processes).

Load it out of tree with::

    --kv-transfer-config '{"kv_connector":"LmiBlendConnector",
                           "kv_connector_module_path":"lmi_cache.blend.connector",
                           "kv_role":"kv_both"}'

and ``enable_blending: true`` in the LMCache YAML (or ``LMCACHE_ENABLE_BLENDING=true``);
``lmi-cache configure`` / ``serve`` render both from ``option.lmcache_enable_blending``
(see ``autoconfig.blend_options``). Counters become ``lmi_cache_blend_*`` series
beside the base connector's (``lmi_cache.metrics.series``): the scheduler's as they
happen, each rank's after every step.
Requests without blendable segments, and every hook this class does not
override, go to ``LmiCacheConnector`` unchanged (exact prefix chunks).

A request is blended when its cached segments reach past what the exact
prefix path would serve (see ``scheduler_plan``). Then:

* the base connector forgets it (no exact-prefix chunk is ever saved from a
  blended request's KV);
* it is cut off from vLLM's prefix cache: its ``cache_salt`` becomes a fresh
  per-request value and its block hashes are recomputed before vLLM allocates
  blocks, so the blocks it fills are registered under hashes no other request
  computes (vLLM 0.32 folds ``cache_salt`` into the first block's hash and
  chains every later one from it). Blocks that vLLM's own exact prefix hit
  already gave it keep their hashes, as they are exact. The request's own
  salt (tenant isolation) still keys its segments;
* the workers blend its segments into its blocks in ``start_load_kv`` and
  vLLM prefills only the tail.

Segments no worker holds are stored by the workers after the step that
schedules the request (a separate forward of each segment alone, at
positions 0..n-1). The model is reached through ``vllm_plugin`` (vLLM general
plugin) or, without it, found from the attention layers vLLM registered.
"""
from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmi_cache.blend.jobs import BlendConnectorMetadata
from lmi_cache.blend.scheduler_plan import BlendScheduler
from lmi_cache.blend.settings import BlendConfigError, BlendSettings, blend_keys_in, blend_keys_in_env
from lmi_cache.metrics.series import blend_stats_follower
from lmi_cache.vllm_connector.connector import LmiCacheConnector
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata, LmiWorkerMeta

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Segment payloads ([layers, 2, T, heads, dim], K at positions 0..T-1) are not chunk payloads: own layout tag.
SEGMENT_LAYOUT_SUFFIX = "+blend-seg-v1"
BLEND_SALT_PREFIX = "lmi-blend:"


def load_blend_settings(env: Mapping[str, str] | None = None) -> BlendSettings:
    """Blending keys from the LMCache YAML (``LMCACHE_CONFIG_FILE``) overridden by ``LMCACHE_<KEY>`` env."""
    from lmi_cache.config import CONFIG_FILE_ENV, read_yaml_mapping
    from lmi_cache.config_values import unquote_env

    env = os.environ if env is None else env
    path = unquote_env(env.get(CONFIG_FILE_ENV, ""))
    values: dict[str, Any] = blend_keys_in(read_yaml_mapping(path)) if path else {}
    values.update(blend_keys_in_env(env))
    return BlendSettings.from_mapping(values, path or "environment")


def _hf_config(vllm_config: VllmConfig) -> dict[str, Any]:
    return vllm_config.model_config.hf_config.to_dict()


def _separator_ids(vllm_config: VllmConfig, special_str: str) -> tuple[int, ...]:
    from transformers import AutoTokenizer

    from lmi_cache.blend.segments import separator_ids

    model_config = vllm_config.model_config
    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer, revision=getattr(model_config, "tokenizer_revision", None),
        trust_remote_code=bool(getattr(model_config, "trust_remote_code", False)),
    )
    return separator_ids(lambda text: tokenizer.encode(text, add_special_tokens=False), special_str)


class LmiBlendConnector(LmiCacheConnector):
    """``LmiCacheConnector`` that also blends cached segments at non-prefix positions."""

    blends = True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self._blend_settings = load_blend_settings()
        if self._blend_settings.enabled:
            from lmi_cache.blend.support import check_blendable

            # Refuse a model blending does not cover before anything else starts (one line, no traceback).
            check_blendable(_hf_config(vllm_config), str(vllm_config.model_config.model))
            self._blend_settings.check_model(int(vllm_config.model_config.hf_config.num_hidden_layers),
                                             str(vllm_config.model_config.model))
        super().__init__(vllm_config, role, kv_cache_config)
        self._vllm_config = vllm_config
        self._blend_scheduler: BlendScheduler | None = None
        self._blend_worker: Any = None
        self._blend_failed_blocks: set[int] = set()
        self._blend_worker_metrics = blend_stats_follower()  # this rank's lmi_cache_blend_* worker series
        self.blend_model_source = ""  # worker: "plugin" or "search" (how the model was reached)
        if not self._blend_settings.enabled:
            return
        if role == KVConnectorRole.SCHEDULER:
            sep = _separator_ids(vllm_config, self._blend_settings.special_str)
            self._blend_scheduler = BlendScheduler(
                self._blend_settings, sep, self._tp_size * self._pp_size, self._segment_key,
                self._blend_scheduler_metrics(),
            )
            logger.info("lmi-cache: blending on (separator %r = token ids %s, check layers %s, ratios %s)",
                        self._blend_settings.special_str, list(sep), list(self._blend_settings.check_layers),
                        list(self._blend_settings.recompute_ratios))

    # -- metrics -------------------------------------------------------------------------

    def _blend_scheduler_metrics(self) -> Any:
        """lmi_cache_blend_* series beside the scheduler's lmi_cache_* ones (same registry, same ``engine``)."""
        from lmi_cache.metrics.series import BlendSchedulerMetrics

        base = getattr(self._scheduler, "metrics", None)
        if base is None:
            return None
        return BlendSchedulerMetrics(base.registry, base.engine_label)

    def _follow_blend_stats(self) -> None:
        """Add what the blend worker counted this step to the rank's lmi_cache_blend_* series."""
        if self._blend_worker is not None:
            engine = getattr(self._worker, "engine", None)
            self._blend_worker_metrics.follow(getattr(engine, "metrics", None), self._blend_worker.stats)

    # -- keys ----------------------------------------------------------------------------

    def _segment_key(self, tokens: Sequence[int], rank: int, layout_tag: str, lora: str | None, salt: str | None) -> Any:
        from lmi_cache.blend.segments import segment_key
        from lmi_cache.keys.hashing import ChunkKey, KeyNamespace

        namespace = KeyNamespace(
            model=self._model_id,
            kv_dtype=self._kv_dtype,
            layout=layout_tag + SEGMENT_LAYOUT_SUFFIX,
            tp_rank=rank % self._tp_size,
            tp_size=self._tp_size,
            pp_rank=rank // self._tp_size,
            pp_size=self._pp_size,
            lora=lora,
            cache_salt=salt,
            model_identity=self._model_identity,
        )
        key = segment_key(tokens, namespace)
        # The engine stores ChunkKeys; a segment is tokens [0, n) of itself.
        return ChunkKey(key.digest, 0, key.num_tokens, key.fingerprint)

    # -- scheduler hooks -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        blender = self._blend_scheduler
        if blender is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        state = blender.state(request.request_id)
        if state is not None and state.isolated:
            _set_salt(request, state.original_salt)  # asked again (no memory last time): start from the truth
            state.isolated = False
        prefix = super().get_num_new_matched_tokens(request, num_computed_tokens)
        layout_tag = getattr(self._scheduler, "layout_tag", None)
        if prefix[0] is None or layout_tag is None:
            return prefix
        try:
            tokens = blender.plan(request, num_computed_tokens, num_computed_tokens + prefix[0], layout_tag)
        except Exception as err:  # noqa: BLE001 - a planning fault is the prefix path
            logger.warning("lmi-cache: blend planning failed for request %s (%r)", request.request_id, err)
            return prefix
        if tokens is None:
            return prefix
        assert self._scheduler is not None
        self._scheduler.request_finished(request.request_id)  # the prefix path forgets it: it saves nothing
        state = blender.state(request.request_id)
        assert state is not None
        _set_salt(request, f"{BLEND_SALT_PREFIX}{uuid.uuid4().hex}")
        state.isolated = True
        return tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self._blend_scheduler is not None:
            self._blend_scheduler.confirm(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        base = super().build_connector_meta(scheduler_output)
        if self._blend_scheduler is None or not isinstance(base, LmiConnectorMetadata):
            return base
        meta = BlendConnectorMetadata(loads=base.loads, saves=base.saves)
        self._blend_scheduler.take_jobs(scheduler_output, meta)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._blend_scheduler is not None and isinstance(worker_meta, LmiWorkerMeta):
            stored = [d for digests in worker_meta.stored_digests.values() for d in digests]
            removed = [d for digests in worker_meta.removed_digests.values() for d in digests]
            self._blend_scheduler.update_from_workers(stored, removed)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._blend_scheduler is not None:
            self._blend_scheduler.finished(request.request_id)
        return super().request_finished(request, block_ids)

    @property
    def blend_scheduler(self) -> BlendScheduler | None:
        return self._blend_scheduler

    # -- worker hooks --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if not self._blend_settings.enabled:
            return
        from lmi_cache.blend.paged_kv import PagedKV
        from lmi_cache.blend.vllm_model import VllmLayerwiseModel, find_model
        from lmi_cache.blend.worker_jobs import BlendWorker

        assert self._worker is not None and self._worker.layout is not None
        names = sorted(kv_caches, key=_layer_index)
        from lmi_cache.blend import vllm_plugin

        static = getattr(self._vllm_config.compilation_config, "static_forward_context", {}) or {}
        self.blend_model_source = "plugin" if vllm_plugin.loaded_model() is not None else "search"
        model = find_model(static.get(names[0]))
        if model is None:
            raise BlendConfigError(
                "enable_blending: the blending connector cannot reach the model; install lmi-cache so that "
                "its vLLM plugin (entry point vllm.general_plugins: lmi_cache_blend) loads, or turn blending off"
            )
        layerwise = VllmLayerwiseModel(model, _hf_config(self._vllm_config), str(self._vllm_config.model_config.model))
        block_size = int(self._vllm_config.cache_config.block_size)
        paged = PagedKV([kv_caches[n] for n in names], self._worker.layout, block_size)
        paged_attention = None
        if self._worker.layout.kind == "cpu":
            from lmi_cache.blend.cpu_paged_attention import CpuPagedAttention
            from lmi_cache.blend.host_heap import blend_heap_bytes, keep_large_allocations_in_heap, prewarm_heap

            first_attn = model.model.layers[0].self_attn
            # Host tensors: the blend's big temporaries come from touched heap, reused across blends.
            if keep_large_allocations_in_heap():
                prewarm_heap(blend_heap_bytes(layerwise.num_layers, int(first_attn.num_kv_heads), layerwise.head_dim,
                                              int(self._vllm_config.model_config.max_model_len)))
            paged_attention = CpuPagedAttention(
                [kv_caches[n] for n in names], [static.get(n) for n in names], block_size,
                int(first_attn.num_heads), int(first_attn.num_kv_heads), layerwise.head_dim, layerwise.attn_scale,
            )
        self._blend_worker = BlendWorker(self._blend_settings, layerwise, paged, self._worker.rank_index,
                                         paged_attention)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._connector_metadata
        if self._blend_worker is not None and self._worker is not None and isinstance(meta, BlendConnectorMetadata) \
                and meta.blends:
            self._blend_failed_blocks |= self._blend_worker.run_blends(meta.blends, self._worker.engine)
            self._follow_blend_stats()

    def wait_for_save(self) -> None:
        super().wait_for_save()
        meta = self._connector_metadata
        if self._blend_worker is not None and self._worker is not None and isinstance(meta, BlendConnectorMetadata) \
                and meta.segment_stores:
            self._blend_worker.run_stores(meta.segment_stores, self._worker.engine)
            self._follow_blend_stats()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._blend_failed_blocks = self._blend_failed_blocks, set()
        return super().get_block_ids_with_load_errors() | failed

    @property
    def blend_worker(self) -> Any:
        return self._blend_worker


def _layer_index(name: str) -> int:
    """``model.layers.7.self_attn.attn`` -> 7 (registration order is not promised to be layer order)."""
    parts = name.split(".")
    for before, part in zip(parts, parts[1:]):
        if before == "layers" and part.isdigit():
            return int(part)
    raise BlendConfigError(f"enable_blending: cannot tell the layer of KV cache {name!r}; turn blending off")


def _set_salt(request: Any, salt: str | None) -> None:
    """Give ``request`` this ``cache_salt`` and recompute its vLLM block hashes from it."""
    request.cache_salt = salt
    hashes = getattr(request, "block_hashes", None)
    if isinstance(hashes, list):
        hashes.clear()
        request.update_block_hashes()

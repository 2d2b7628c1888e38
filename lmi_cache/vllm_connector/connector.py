"""LmiCacheConnector: the vLLM KV connector facade (vLLM scheduler and worker processes).

Load it out of tree with::

    --kv-transfer-config '{"kv_connector":"LmiCacheConnector",
                           "kv_connector_module_path":"lmi_cache.vllm_connector",
                           "kv_role":"kv_both"}'

and configure it with the LMCache-format YAML in ``LMCACHE_CONFIG_FILE`` plus
``LMCACHE_*`` env. vLLM builds one instance with role SCHEDULER in the
scheduler process and one with role WORKER per worker process; this class only
routes each hook to :class:`SchedulerSide` (bookkeeping, no tensors) or
:class:`WorkerSide` (bytes, no policy). Only small dataclasses cross between
them (``metadata.py``).

Blending (CacheBlend-style reuse of cached documents at any position) is a
part of this connector, on when ``enable_blending`` is true in the LMCache YAML
(or ``LMCACHE_ENABLE_BLENDING``): the connector then composes
``blending.ConnectorBlending`` and calls it from its hooks after the exact
prefix path, which always wins where it hits. ``LmiBlendConnector`` is the
earlier name of that setup, kept so existing launch arguments still work.

Start-up checks: the chunk size must be a multiple of vLLM's block size; an
unknown KV layout is refused by the worker. A KV load that fails is reported
through ``get_block_ids_with_load_errors`` and vLLM recomputes those blocks; to
make that the behaviour, the scheduler-side instance switches vLLM's
``kv_load_failure_policy`` from its default "fail" to "recompute" (a cache
fault must never fail a request).

Peer tier (``enable_p2p``): each worker rank serves its CPU tier to peers and
reads chunks from the peer a request's router names (``lmi_cache.peer``); the
scheduler asks that peer which chunks it holds, like the remote store.

Hybrid state-space models are served with prefix caching in vLLM's "align"
mode (``startup.warn_on_sparse_state_retention`` says how, and what it needs).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from lmi_cache.blend.settings import BlendSettings, load_blend_settings
from lmi_cache.keys.hashing import KeySpace
from lmi_cache.vllm_connector.blending import BlendContext, ConnectorBlending, check_model
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata, LmiWorkerMeta
from lmi_cache.vllm_connector.scheduler_side import SchedulerSide
from lmi_cache.vllm_connector.side_builders import (
    Deployment,
    build_scheduler_side,
    build_worker_side,
    start_worker_peer,
    worker_rank_index,
)
from lmi_cache.vllm_connector.startup import (
    check_chunk_size,
    kv_groups,
    load_cache_config,
    warn_on_sparse_state_retention,
)
from lmi_cache.vllm_connector.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# The metadata module stays vLLM-free; here, where vLLM is imported anyway, its classes become virtual
# subclasses of vLLM's abstract bases, so an isinstance check in vLLM (or another connector) still holds.
KVConnectorMetadata.register(LmiConnectorMetadata)
KVConnectorWorkerMetadata.register(LmiWorkerMeta)


class LmiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector storing prompt chunks in lmi_cache tiers (CPU RAM, disk, remote), blending when configured.

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``): sliding-window
    and hybrid state-space models keep it on, and each KV cache group is cached
    on its own (blending refuses both at start, in ``check_model``).
    """

    force_blending = False  # LmiBlendConnector (the earlier name) says True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best-effort cache: a dropped save is only a future miss

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        blend_settings = self._blend_settings()
        if blend_settings.enabled:
            check_model(blend_settings, vllm_config)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._config = load_cache_config()
        block_size = int(vllm_config.cache_config.block_size)
        check_chunk_size(self._config.chunk_size, block_size)
        self._kv_groups = kv_groups(kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            warn_on_sparse_state_retention(self._kv_groups, kv_cache_config, self._config.chunk_size)
        # Keys are built by the scheduler only (workers get them in the metadata): identify the weights there.
        # The peer tier's handshake compares it too, so with enable_p2p the workers identify the weights as well.
        self._deployment = Deployment.of(vllm_config, self._config.chunk_size,
                                         identify_weights=role == KVConnectorRole.SCHEDULER or self._config.enable_p2p)
        self._peer_node: Any = None  # lmi_cache.peer.node.PeerNode of this worker rank (enable_p2p)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._remote_lookups: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler, self._remote_lookups = build_scheduler_side(
                self._config, self._deployment, vllm_config, kv_cache_config, self._kv_transfer_config,
                block_size=block_size, groups=self._kv_groups)
        else:
            self._worker = build_worker_side(self._config, self._deployment, vllm_config, block_size=block_size,
                                             groups=self._kv_groups)
        self._blending: ConnectorBlending | None = None
        if blend_settings.enabled:
            metrics = self._scheduler.metrics if self._scheduler is not None else None
            directory = self._scheduler.directory if self._scheduler is not None else None
            context = BlendContext(blend_settings, vllm_config, self.key_space, block_size, metrics, directory)
            self._blending = ConnectorBlending(context, scheduler=role == KVConnectorRole.SCHEDULER)

    def _blend_settings(self) -> BlendSettings:
        settings = load_blend_settings()
        if self.force_blending and not settings.enabled:
            return dataclasses.replace(settings, enabled=True)
        return settings

    # -- construction --------------------------------------------------------------------

    def key_space(self, layout_tag: str) -> KeySpace:
        """The deployment's key space for the workers' KV layout tag (the scheduler's keys, blending's segments)."""
        return self._deployment.key_space(layout_tag)

    # -- worker hooks --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.rank_index = worker_rank_index(self._deployment.tp_size)
        self._worker.register_kv_caches(kv_caches)
        if self._config.enable_p2p:
            self._peer_node = start_worker_peer(self._config, self._deployment, self._worker)
        if self._blending is not None:
            assert self._worker.layout is not None
            self._blending.register(kv_caches, self._worker.layout, self._worker.rank_index)

    def _meta(self) -> LmiConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, LmiConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.load(meta)  # the exact prefix first: blends read it from the blocks
            if self._blending is not None:
                self._blending.run_blends(meta, self._worker)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous and complete before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole chunks of all layers are gathered once, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.save(meta)
            if self._blending is not None:
                self._blending.run_stores(meta, self._worker)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads (models that are not one full-attention group): done, or failed (vLLM recomputes those)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.take_async_results()
        return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = self._worker.take_failed_block_ids() if self._worker is not None else set()
        if self._blending is not None:
            failed |= self._blending.take_failed_block_ids()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta: LmiWorkerMeta | None = self._worker.build_worker_meta() if self._worker is not None else None
        return meta  # type: ignore[return-value]  # a registered virtual subclass (see above), which mypy does not see

    def shutdown(self) -> None:
        if self._peer_node is not None:
            self._peer_node.close()
            self._peer_node = None
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._remote_lookups is not None:
            self._remote_lookups.close(flush_timeout_s=0.0)
            self._remote_lookups = None

    @property
    def worker_side(self) -> WorkerSide | None:
        return self._worker

    @property
    def scheduler_side(self) -> SchedulerSide | None:
        return self._scheduler

    @property
    def blending(self) -> ConnectorBlending | None:
        """The blending component (None with blending off)."""
        return self._blending

    # -- scheduler hooks -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            prefix_tokens, load_async = self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as err:  # noqa: BLE001 - a lookup fault is a miss
            logger.warning("lmi-cache: lookup failed for request %s (%s); treated as a miss", request.request_id, err)
            return 0, False
        if self._blending is None or prefix_tokens is None:
            return prefix_tokens, load_async
        # After the exact prefix path, which wins where it hits: the blend starts where it ends.
        return self._blending.matched_tokens(request, num_computed_tokens, prefix_tokens,
                                             self._scheduler.layout_tag), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        share = self._blending.after_alloc(request, num_external_tokens) if self._blending is not None else None
        if share is None:
            block_ids = blocks.get_block_ids() if num_external_tokens > 0 else None
            self._scheduler.update_state_after_alloc(request, num_external_tokens, block_ids=block_ids)
        else:  # blended: the prefix path loads its exact share and saves nothing of this request
            self._scheduler.update_state_after_alloc(request, share, saves=False)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._scheduler.build_connector_meta(scheduler_output)
        if self._blending is not None:
            meta = self._blending.add_jobs(meta, scheduler_output)
        self._scheduler.finish_step(meta)
        return meta  # type: ignore[return-value]  # a registered virtual subclass (see above), which mypy does not see

    def take_events(self) -> list[Any]:
        """The CPU and disk tiers' KV events since the last call (vLLM publishes them after its own)."""
        if self._scheduler is None or self._scheduler.directory.events is None:
            return []
        from lmi_cache.vllm_connector.kv_events import to_vllm_events

        return to_vllm_events(self._scheduler.directory.take_events())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_from_workers(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._blending is not None:
            self._blending.finished(request.request_id)
        if self._scheduler is not None:
            self._scheduler.request_finished(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid manager's end of a request: saves are synchronous, so every group's blocks are free to go."""
        return self.request_finished(request, block_ids[0] if block_ids else [])


class LmiBlendConnector(LmiCacheConnector):
    """The earlier name of ``LmiCacheConnector`` with blending on; kept so existing launch arguments work."""

    force_blending = True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        logger.warning("lmi-cache: LmiBlendConnector is deprecated: load LmiCacheConnector "
                       "(kv_connector_module_path lmi_cache.vllm_connector) with enable_blending: true instead")
        super().__init__(vllm_config, role, kv_cache_config)

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

Start-up checks: the chunk size must be a multiple of vLLM's block size; an
unknown KV layout is refused by the worker. A KV load that fails is reported
through ``get_block_ids_with_load_errors`` and vLLM recomputes those blocks; to
make that the behaviour, the scheduler-side instance switches vLLM's
``kv_load_failure_policy`` from its default "fail" to "recompute" (a cache
fault must never fail a request).
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from lmi_cache.keys.hashing import KeySpace
from lmi_cache.errors import ConfigError
from lmi_cache.transfer.layouts import ExpectedGeometry
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata
from lmi_cache.vllm_connector.scheduler_side import SchedulerGeometry, SchedulerSide
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


def _kv_dtype_name(vllm_config: VllmConfig) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype == "auto":
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    return cache_dtype


def _parallel_sizes(vllm_config: VllmConfig) -> tuple[int, int]:
    parallel = vllm_config.parallel_config
    return int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)


def _dp_index(vllm_config: VllmConfig) -> int:
    """This engine's data-parallel replica (vLLM's ``engine`` label); 0 without data parallelism."""
    parallel = vllm_config.parallel_config
    return int(getattr(parallel, "data_parallel_index", None) or getattr(parallel, "data_parallel_rank", 0) or 0)


def _weights_identity(vllm_config: VllmConfig) -> str:
    from lmi_cache.keys.model_identity import served_model_identity

    started = time.perf_counter()
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    identity = served_model_identity(vllm_config.model_config, download_dir)
    logger.info("lmi-cache: model identity %s (%.3f s)", identity, time.perf_counter() - started)
    return identity


def _load_cache_config(blends: bool = False) -> Any:
    from lmi_cache.config import load_config

    config, warnings = load_config()
    for warning in warnings:
        logger.warning("lmi-cache: %s", warning)
    if config.enable_blending and not blends:
        logger.warning("lmi-cache: enable_blending is on, but blending needs the blending connector (kv_connector "
                       "LmiBlendConnector, kv_connector_module_path lmi_cache.blend.connector); LmiCacheConnector "
                       "reuses exact prefixes only")
    for key in ("save_unfull_chunk", "save_decode_cache"):
        if getattr(config, key):
            # The engine stores partial chunks, but vLLM's paged cache only hands
            # over whole blocks: the connector saves full prompt chunks only.
            logger.warning("lmi-cache: %s is set but the vLLM connector saves full prompt chunks only; "
                           "it has no effect here", key)
    return config


def _check_chunk_size(chunk_size: int, block_size: int) -> None:
    if chunk_size <= 0 or chunk_size % block_size:
        raise ConfigError(
            f"chunk_size: {chunk_size} is not a multiple of vLLM's block size {block_size}; "
            f"set chunk_size (LMCACHE_CHUNK_SIZE) to a multiple of {block_size}"
        )


class LmiCacheConnector(KVConnectorBase_V1):
    """KV connector storing prompt chunks in lmi_cache tiers (CPU RAM, disk, remote)."""

    blends = False  # the blending connector (a subclass) says True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best-effort cache: a dropped save is only a future miss

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._config = _load_cache_config(self.blends)
        block_size = int(vllm_config.cache_config.block_size)
        _check_chunk_size(self._config.chunk_size, block_size)
        self._model_id = str(vllm_config.model_config.model)
        self._kv_dtype = _kv_dtype_name(vllm_config)
        self._tp_size, self._pp_size = _parallel_sizes(vllm_config)
        self._dp_index = _dp_index(vllm_config)
        # Keys are built by the scheduler only (workers get them in the metadata): identify the weights there.
        self._model_identity = _weights_identity(vllm_config) if role == KVConnectorRole.SCHEDULER else ""
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._remote_lookups: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(block_size)
        else:
            self._init_worker(vllm_config, block_size)

    # -- construction --------------------------------------------------------------------

    def _key_space(self, layout_tag: str) -> KeySpace:
        return KeySpace(
            model=self._model_id,
            kv_dtype=self._kv_dtype,
            layout=layout_tag,
            chunk_size=self._config.chunk_size,
            tp_size=self._tp_size,
            pp_size=self._pp_size,
            model_identity=self._model_identity,
        )

    def _init_scheduler(self, block_size: int) -> None:
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            logger.info("lmi-cache: kv_load_failure_policy set to 'recompute' (a cache miss must not fail a request)")
        seed: set[bytes] = set()
        if self._config.local_disk:
            started = time.perf_counter()
            try:
                from lmi_cache.engine import scan_persisted_digests
                from lmi_cache.tiers.disk.ranks import prune_orphan_rank_dirs

                world_size = self._tp_size * self._pp_size
                prune_orphan_rank_dirs(self._config.local_disk, self._dp_index, world_size)
                seed = set(scan_persisted_digests(self._config, self._dp_index, world_size))
            except Exception as err:  # noqa: BLE001 - a cold index is only slower
                logger.warning("lmi-cache: could not scan the disk tier (%s); starting with an empty index", err)
            logger.info("lmi-cache: seeded the index with %d persisted chunks in %.3f s", len(seed), time.perf_counter() - started)
        geometry = SchedulerGeometry(
            block_size_tokens=block_size,
            chunk_size_tokens=self._config.chunk_size,
            world_size=self._tp_size * self._pp_size,
            min_retrieve_tokens=self._config.min_retrieve_tokens,
        )
        from lmi_cache.metrics.series import SchedulerMetrics
        from lmi_cache.metrics.server import note_where_metrics_go, serve_metrics

        metrics = SchedulerMetrics(engine_label=str(self._dp_index))
        note_where_metrics_go()
        serve_metrics(metrics.registry, dp_rank=self._dp_index, world_size=geometry.world_size, rank=None)
        self._scheduler = SchedulerSide(geometry, self._key_space, seed, metrics, remote=self._open_remote_lookups(),
                                        sessions=self._session_tracker())

    def _session_tracker(self) -> Any:
        """Which sessions are open (for retention in the CPU tier), or None when retention is off."""
        if self._config.session_retention_share <= 0 or self._config.cpu_capacity_bytes <= 0:
            return None
        from lmi_cache.eviction.session_tracker import SessionSource, SessionTracker

        source = SessionSource.from_env(os.environ)
        logger.info("lmi-cache: open sessions keep up to %.0f%% of the CPU tier (sessions from %s)",
                    100 * self._config.session_retention_share,
                    source.store_path or f"requests, released after {source.expiration_s:.0f} s idle")
        return SessionTracker(source)

    def _open_remote_lookups(self) -> Any:
        """The scheduler's client of the remote store (existence checks only), or None without one."""
        from lmi_cache.config_remote import remote_settings

        settings = remote_settings(self._config, "lmi-cache config")
        if settings is None:
            return None
        from lmi_cache.remote import open_remote

        self._remote_lookups = open_remote(settings)
        logger.info("lmi-cache: scheduler looks up chunks in the %s store %s (timeout %d ms)", settings.kind,
                    settings.display_url, settings.lookup_timeout_ms)
        return self._remote_lookups

    def _init_worker(self, vllm_config: VllmConfig, block_size: int) -> None:
        model_config = vllm_config.model_config
        is_mla = bool(getattr(model_config, "use_mla", False))
        geometry = ExpectedGeometry(
            block_size_tokens=block_size,
            num_kv_heads=1 if is_mla else int(model_config.get_num_kv_heads(vllm_config.parallel_config)),
            head_size=int(model_config.get_head_size()),
            is_mla=is_mla,
        )
        config = self._config

        def make_engine() -> Any:
            from lmi_cache.engine import CacheEngine
            from lmi_cache.metrics.series import CacheMetrics
            from lmi_cache.metrics.server import serve_metrics
            from lmi_cache.tiers.disk.ranks import rank_label

            rank = self._rank_index()
            metrics = CacheMetrics(str(rank), engine_label=str(self._dp_index))
            # rank_label names the disk directory: rank<r>, or rank<r>-dp<d> for data-parallel replica d > 0.
            engine = CacheEngine(config, metrics=metrics, rank_label=rank_label(rank, self._dp_index))
            serve_metrics(metrics.registry, dp_rank=self._dp_index, world_size=self._tp_size * self._pp_size,
                          rank=rank)
            return engine

        self._worker = WorkerSide(
            rank_index=0, geometry=geometry, chunk_size_tokens=config.chunk_size, engine_factory=make_engine
        )

    def _rank_index(self) -> int:
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            return int(get_pp_group().rank_in_group) * self._tp_size + int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - no distributed state: a single-rank worker
            return 0

    # -- worker hooks --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.rank_index = self._rank_index()
        self._worker.register_kv_caches(kv_caches)

    def _meta(self) -> LmiConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, LmiConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous and complete before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole chunks of all layers are gathered once, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_block_ids() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        return self._worker.build_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._remote_lookups is not None:
            self._remote_lookups.close(flush_timeout_s=0.0)
            self._remote_lookups = None

    @property
    def worker_side(self) -> WorkerSide | None:
        return self._worker

    @property
    def scheduler_side(self) -> SchedulerSide | None:
        return self._scheduler

    # -- scheduler hooks -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as err:  # noqa: BLE001 - a lookup fault is a miss
            logger.warning("lmi-cache: lookup failed for request %s (%s); treated as a miss", request.request_id, err)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_from_workers(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.request_finished(request.request_id)
        return False, None

"""Builds the connector's scheduler side and worker side from vLLM's config (vLLM scheduler and worker processes).

``connector.py`` routes vLLM's hooks; what each side needs at start lives here: the scheduler side's
metrics server, placement directory (the disk tier's files adopted), KV-event reader, remote-store and
peer lookups; a worker's expected KV geometry, the factory of its rank's engine (built only once vLLM
registers its KV caches, when the rank is known) and its peer node. Runs once per process, when vLLM
builds the connector.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmi_cache.keys.hashing import KeySpace
from lmi_cache.keys.key_inputs import KeyRule, environment_trusts_mm_ids
from lmi_cache.keys.kv_groups import KvCacheGroup
from lmi_cache.transfer.layouts import ExpectedGeometry
from lmi_cache.vllm_connector.request_plan import SchedulerGeometry
from lmi_cache.vllm_connector import startup
from lmi_cache.vllm_connector.scheduler_side import SchedulerSide
from lmi_cache.vllm_connector.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from lmi_cache.config.cache_config import CacheConfig
    from lmi_cache.engine import Engine

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Deployment:
    """What the key space and both sides read from vLLM's config once: model, dtype, parallelism, weights."""

    model_id: str
    kv_dtype: str
    chunk_size: int
    tp_size: int
    pp_size: int
    dp_index: int  # this engine's data-parallel replica
    model_identity: str  # the weights' (and drafter's) identity; "" where no key is built

    @classmethod
    def of(cls, vllm_config: VllmConfig, chunk_size: int, *, identify_weights: bool) -> Deployment:
        """Read from vLLM's config; ``identify_weights`` hashes the weights (only where keys are built)."""
        tp_size, pp_size = startup.parallel_sizes(vllm_config)
        return cls(
            model_id=str(vllm_config.model_config.model),
            kv_dtype=startup.kv_dtype_name(vllm_config),
            chunk_size=chunk_size,
            tp_size=tp_size,
            pp_size=pp_size,
            dp_index=startup.dp_index(vllm_config),
            model_identity=(startup.weights_identity(vllm_config) + startup.drafter_identity(vllm_config)
                            if identify_weights else ""),
        )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def key_space(self, layout_tag: str) -> KeySpace:
        """The deployment's key space for the workers' KV layout tag (the scheduler's keys, blending's segments)."""
        return KeySpace(model=self.model_id, kv_dtype=self.kv_dtype, layout=layout_tag, chunk_size=self.chunk_size,
                        tp_size=self.tp_size, pp_size=self.pp_size, model_identity=self.model_identity)


def build_scheduler_side(
    config: CacheConfig,
    deployment: Deployment,
    vllm_config: VllmConfig,
    kv_cache_config: Any,
    kv_transfer_config: Any,
    *,
    block_size: int,
    groups: tuple[KvCacheGroup, ...],
) -> tuple[SchedulerSide, Any]:
    """The scheduler side, and its client of the remote store (None without one; the connector closes it).
    vLLM's ``kv_load_failure_policy`` becomes "recompute": a cache fault must never fail a request."""
    from lmi_cache.metrics.scheduler_series import SchedulerMetrics
    from lmi_cache.metrics.server import note_where_metrics_go, serve_metrics
    from lmi_cache.placement.event_journal import journal_path
    from lmi_cache.placement.startup import build_directory, open_remote_lookups, session_tracker
    from lmi_cache.vllm_connector.kv_events import event_blocks_reader

    if getattr(kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
        kv_transfer_config.kv_load_failure_policy = "recompute"
        logger.info("lmi-cache: kv_load_failure_policy set to 'recompute' (a cache miss must not fail a request)")
    drafter = startup.drafter_planning(vllm_config, block_size)
    key_rule = KeyRule(mm_ids_are_content=environment_trusts_mm_ids(vllm_config))
    geometry = SchedulerGeometry(
        block_size_tokens=block_size,
        chunk_size_tokens=config.chunk_size,
        world_size=deployment.world_size,
        min_retrieve_tokens=config.min_retrieve_tokens,
        **({"groups": groups} if groups else {}),
        drafter_backoff_tokens=drafter[0],  # speculative decoding: see startup.drafter_planning
        unfinal_tail_tokens=drafter[1],
    )
    replica = deployment.dp_index
    metrics = SchedulerMetrics(engine_label=str(replica))
    note_where_metrics_go()
    serve_metrics(metrics.registry, dp_rank=replica, world_size=geometry.world_size, rank=None)
    sessions = session_tracker(config)
    remote_lookups = open_remote_lookups(config)  # existence checks only
    directory = build_directory(config, replica=replica, world_size=geometry.world_size, remote=remote_lookups,
                                retention=sessions is not None, metrics=metrics,
                                num_replicas=startup.dp_size(vllm_config))
    reader = event_blocks_reader(vllm_config, kv_cache_config, geometry.block_size_tokens, config.chunk_size,
                                 directory, journal_path(config.local_disk, replica))
    peer_lookups = None
    if config.enable_p2p:
        from lmi_cache.peer.holders import open_peer_holders
        from lmi_cache.peer.lookup import PeerLookups

        peer_lookups = PeerLookups(config.peer_timeout_ms, geometry.world_size, holders=open_peer_holders(config))
    side = SchedulerSide(geometry, deployment.key_space, directory, metrics, sessions=sessions, key_rule=key_rule,
                         chunk_blocks=reader, peer_lookups=peer_lookups)
    return side, remote_lookups


def build_worker_side(
    config: CacheConfig,
    deployment: Deployment,
    vllm_config: VllmConfig,
    *,
    block_size: int,
    groups: tuple[KvCacheGroup, ...],
) -> WorkerSide:
    """A worker's side; its engine is built when vLLM registers the KV caches (its rank is known then)."""
    model_config = vllm_config.model_config
    is_mla = bool(getattr(model_config, "use_mla", False))
    geometry = ExpectedGeometry(
        block_size_tokens=block_size,
        num_kv_heads=1 if is_mla else int(model_config.get_num_kv_heads(vllm_config.parallel_config)),
        head_size=int(model_config.get_head_size()),
        is_mla=is_mla,
    )

    def make_engine() -> Engine:
        from lmi_cache.engine import CacheEngine
        from lmi_cache.metrics.worker_series import CacheMetrics
        from lmi_cache.metrics.server import serve_metrics
        from lmi_cache.tiers.disk.ranks import rank_label

        rank, replica = worker_rank_index(deployment.tp_size), deployment.dp_index
        metrics = CacheMetrics(str(rank), engine_label=str(replica))
        # rank_label names the disk directory: rank<r>, or rank<r>-dp<d> for data-parallel replica d > 0.
        engine = CacheEngine(config, metrics=metrics, rank_label=rank_label(rank, replica))
        serve_metrics(metrics.registry, dp_rank=replica, world_size=deployment.world_size, rank=rank)
        return engine

    return WorkerSide(rank_index=0, geometry=geometry, chunk_size_tokens=config.chunk_size,
                      engine_factory=make_engine, groups=groups)


def start_worker_peer(config: CacheConfig, deployment: Deployment, worker: WorkerSide) -> Any:
    """This rank's peer node (``enable_p2p``: serves its CPU tier, reads a peer's), or None without an engine."""
    from lmi_cache.engine import CacheEngine
    from lmi_cache.peer.node import start_peer_node
    from lmi_cache.peer.protocol import PeerIdentity

    engine = worker.engine
    if not isinstance(engine, CacheEngine):
        return None
    identity = PeerIdentity.of(deployment.key_space(worker.layout_tag))
    return start_peer_node(config, identity, worker.rank_index, deployment.world_size, engine)


def worker_rank_index(tp_size: int) -> int:
    """This worker's rank across tensor and pipeline parallelism (0 without vLLM's distributed state)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_pp_group().rank_in_group) * tp_size + int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no distributed state: a single-rank worker
        return 0

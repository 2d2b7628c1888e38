"""Serving settings: what the planner needs to know about how vLLM will run.

Filled from CLI flags (``plan``) or from serving.properties / OPTION_* env
(``configure``, ``serve``) by ``autoconfig.lmi.properties``. Pure data.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lmi_cache.blend.settings import BlendSettings
from lmi_cache.config.peer import HolderRecords


@dataclass(frozen=True)
class TierOverrides:
    """Explicit user choices the planner honours (and checks against the host).

    Set via serving.properties ``option.lmcache_*`` (see README) or CLI flags.
    None means "let the planner decide".
    """

    cpu_size_gib: float | None = None  # per rank, LMCache semantics; 0 disables the CPU tier
    disk_size_gib: float | None = None  # per rank; 0 disables the disk tier
    disk_path: str | None = None  # directory for the disk tier
    chunk_size: int | None = None  # tokens per chunk
    use_odirect: bool | None = None
    remote_url: str | None = None  # the fleet's shared store (LMCache remote_url): redis/valkey/unix/s3
    session_retention_share: float | None = None  # CPU-tier share kept for open stateful sessions; 0: off
    # The peer tier (LMCache's P2P keys; autoconfig.plan.peer plans it): on, where peers reach us, ports per rank.
    enable_p2p: bool | None = None
    p2p_host: str | None = None
    p2p_init_ports: tuple[int, ...] | None = None
    p2p_lookup_ports: tuple[int, ...] | None = None
    peer_timeout_ms: int | None = None
    # Where peers find holders without a hint, resolved by lmi_cache.config.peer.holder_records from
    # peer_holders_url and a Redis/Valkey remote_url (None: hints only); own=True is written as peer_holders_url.
    peer_holders: HolderRecords | None = None


@dataclass(frozen=True)
class ServingSettings:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    gpu_memory_utilization: float = 0.9  # vLLM's default
    max_model_len: int | None = None  # None: the model's own maximum
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype
    dtype: str = "auto"  # vLLM's --dtype (model compute dtype)
    engine: str = "lmi_cache"  # "lmi_cache" or "lmcache" (upstream LMCacheConnectorV1)
    overrides: TierOverrides = TierOverrides()
    # Blending (enable_blending and the blend_* keys) as the server will read them: LMI options, or the
    # user's LMCache YAML, then LMCACHE_* env on top (see autoconfig.lmi.blend_options).
    blend: BlendSettings = BlendSettings()
    blend_where: str = ""  # the enable_blending setting that counts, for messages ("OPTION_...=true"; "": off)

    @property
    def blend_connector(self) -> bool:
        """Whether LmiCacheConnector blends (blending on, with this project's engine)."""
        return self.blend.enabled and self.engine == "lmi_cache"

    @property
    def ranks_per_host(self) -> int:
        """Every rank of every data-parallel replica on this host holds its own tiers."""
        return self.tp * self.pp * self.dp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

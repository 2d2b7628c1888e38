"""Planner inputs and outputs: plain dataclasses, the ``plan --json`` contract.

Built by ``autoconfig.plan.planner.plan_tiers`` (container-start process, or the
``lmi-cache plan`` CLI) and read by the renderers, ``configure`` and tests.
Pure data: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from lmi_cache.errors import UserError
from lmi_cache.kv_layout import KvLayout

if TYPE_CHECKING:
    from autoconfig.model.ssm import StateLayout
    from autoconfig.plan.peer import PeerPlan
    from lmi_cache.blend.settings import BlendSettings

GIB = 1 << 30
MIB = 1 << 20
KIB = 1 << 10


class PlanError(UserError):
    """The requested settings cannot be served on this host (names the option)."""


class _KvLike(Protocol):
    @property
    def layout(self) -> KvLayout: ...

    @property
    def max_position_embeddings(self) -> int | None: ...


class ModelInfoLike(Protocol):
    """What the planner reads from ``autoconfig.model.source.ModelInfo`` (read-only members)."""

    @property
    def name(self) -> str: ...

    @property
    def kv(self) -> _KvLike: ...

    @property
    def weights_bytes(self) -> int: ...


@dataclass(frozen=True)
class PlanModel:
    """The model as the planner sees it: KV geometry plus weight bytes."""

    layout: KvLayout
    weights_bytes: int
    max_position_embeddings: int | None = None
    name: str = ""
    notes: tuple[str, ...] = ()  # how the geometry/weights were resolved (shown in explanations)
    num_attention_heads: int | None = None  # query heads; None: unknown (a bare layout), not checked
    config: Mapping[str, Any] | None = None  # config.json as read; None: unknown (a bare layout), not checked
    sliding_window: int | None = None  # tokens a windowed layer attends to; None: no windowed layers
    num_sliding_layers: int = 0
    state: StateLayout | None = None  # hybrid models: the state layers' per-request state; None: attention only

    @classmethod
    def coerce(cls, model: "PlanModel | ModelInfoLike | KvLayout") -> "PlanModel":
        """Accept a ModelInfo (duck-typed, so planner never imports model_source) or a bare layout."""
        if isinstance(model, PlanModel):
            return model
        if isinstance(model, KvLayout):
            return cls(layout=model, weights_bytes=0, name=model.model_name)
        kv = model.kv
        return cls(
            layout=kv.layout,
            weights_bytes=int(model.weights_bytes or 0),
            max_position_embeddings=getattr(kv, "max_position_embeddings", None),
            name=getattr(model, "name", "") or kv.layout.model_name,
            notes=tuple(getattr(kv, "notes", ()) or ()) + _weights_note(model),
            num_attention_heads=getattr(kv, "num_attention_heads", None),
            config=getattr(model, "config", None) or None,
            sliding_window=getattr(kv, "sliding_window", None),
            num_sliding_layers=int(getattr(kv, "num_sliding_layers", 0) or 0),
            state=getattr(kv, "state", None),
        )


def _weights_note(model: object) -> tuple[str, ...]:
    source = getattr(model, "weights_source", "")
    return (f"weights_bytes {getattr(model, 'weights_bytes', 0):,}: {source}",) if source else ()


@dataclass(frozen=True)
class CpuTierPlan:
    enabled: bool
    bytes_per_rank: int  # what LMCache will allocate per rank (GiB rounded down to 0.01)
    capacity_tokens: int  # per rank, whole chunks only
    fit_bytes_per_rank: int  # the most that fits per rank, before rounding/override
    # Share of the tier where open stateful sessions' chunks are evicted last (0: no session retention).
    session_retention_share: float = 0.0

    @property
    def session_retention_bytes_per_rank(self) -> int:
        return int(self.bytes_per_rank * self.session_retention_share)

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "bytes_per_rank": self.bytes_per_rank,
            "capacity_tokens": self.capacity_tokens,
            "fit_bytes_per_rank": self.fit_bytes_per_rank,
            "session_retention_share": self.session_retention_share,
            "session_retention_bytes_per_rank": self.session_retention_bytes_per_rank,
        }


@dataclass(frozen=True)
class DiskTierPlan:
    enabled: bool
    path: str | None  # directory for the chunk files
    mount: str | None  # the filesystem it lives on
    bytes_per_rank: int
    capacity_tokens: int
    use_odirect: bool
    fit_bytes_per_rank: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "path": self.path,
            "mount": self.mount,
            "bytes_per_rank": self.bytes_per_rank,
            "capacity_tokens": self.capacity_tokens,
            "use_odirect": self.use_odirect,
            "fit_bytes_per_rank": self.fit_bytes_per_rank,
        }


@dataclass(frozen=True)
class GpuPlan:
    backend: str  # "cuda" or "cpu" (vLLM's CPU backend: KV lives in host RAM)
    num_gpus: int
    kv_bytes_per_rank: int
    kv_capacity_tokens: int  # per rank; a TP/PP group shares the same token count
    block_size: int  # vLLM's KV block size on this backend
    cpu_kvcache_space_gib: int | None  # VLLM_CPU_KVCACHE_SPACE, CPU backend only

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "num_gpus": self.num_gpus,
            "kv_bytes_per_rank": self.kv_bytes_per_rank,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "block_size": self.block_size,
            "cpu_kvcache_space_gib": self.cpu_kvcache_space_gib,
        }


@dataclass(frozen=True)
class LmiReference:
    """What AWS LMI's ``lmcache_auto_config`` formula gives on the same host (for comparison)."""

    cpu_gib_per_rank: int
    disk_gib_per_rank: int | None  # None: no /tmp filesystem in the snapshot
    disk_path: str = "/tmp/lmcache/"

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu_gib_per_rank": self.cpu_gib_per_rank,
            "disk_gib_per_rank": self.disk_gib_per_rank,
            "disk_path": self.disk_path,
        }


@dataclass(frozen=True)
class TierPlan:
    model_name: str
    kv_dtype: str
    kv_bytes_per_token: int
    kv_bytes_per_token_per_rank: int
    weights_bytes: int
    max_model_len: int
    tp: int
    pp: int
    dp: int
    ranks_per_host: int
    gpu: GpuPlan
    cpu: CpuTierPlan
    disk: DiskTierPlan
    chunk_size: int
    lmi_reference: LmiReference
    engine: str = "lmi_cache"
    lmcache_config: dict[str, Any] = field(default_factory=dict)
    vllm_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # env vars the server must run with
    warnings: list[str] = field(default_factory=list)
    explanation: list[str] = field(default_factory=list)
    remote_url: str | None = None  # the fleet's shared store behind the local tiers (None: no remote tier)
    blend: BlendSettings | None = None  # blending in LmiCacheConnector (None: off or not ours)
    peer: PeerPlan | None = None  # the peer tier (None: off)

    def to_dict(self) -> dict[str, Any]:
        """The ``plan --json`` contract (issue 2); byte counts are ints; ``remote`` only with a remote tier."""
        data = self._to_dict()
        if self.remote_url:
            from lmi_cache.remote.url import redact_url

            data["tiers"]["remote"] = {"url": redact_url(self.remote_url),
                                       "chunk_bytes_per_rank": self.kv_bytes_per_token_per_rank * self.chunk_size}
        if self.peer is not None:
            data["tiers"]["peer"] = self.peer.to_dict()
        if self.blend is not None:  # only when on: plans without blending keep their documented shape
            data["blending"] = {"connector": "LmiCacheConnector", **self.blend.to_lmcache_dict()}
        return data

    def _to_dict(self) -> dict[str, Any]:
        return {
            "model": {
                "name": self.model_name,
                "kv_dtype": self.kv_dtype,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_bytes_per_token_per_rank": self.kv_bytes_per_token_per_rank,
                "weights_bytes": self.weights_bytes,
                "max_model_len": self.max_model_len,
            },
            "parallel": {
                "tp": self.tp,
                "pp": self.pp,
                "dp": self.dp,
                "ranks_per_host": self.ranks_per_host,
            },
            "gpu": self.gpu.to_dict(),
            "tiers": {"cpu": self.cpu.to_dict(), "disk": self.disk.to_dict()},
            "chunk_size": self.chunk_size,
            "engine": self.engine,
            "lmcache_config": self.lmcache_config,
            "vllm_args": list(self.vllm_args),
            "env": dict(self.env),
            "lmi_reference": self.lmi_reference.to_dict(),
            "warnings": list(self.warnings),
            "explanation": list(self.explanation),
        }

"""Render a TierPlan as the LMCache-format config (dict and YAML text).

Run by ``plan``/``configure`` (container-start process). The dict is what both
upstream LMCache and ``lmi_cache.config.cache_config`` read: sizes are GiB per rank, rounded
DOWN to two decimals so the file never asks for more than the plan sized.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoconfig.plan.types import GIB

if TYPE_CHECKING:
    from autoconfig.plan.types import TierPlan


def gib_2dp_floor(num_bytes: int) -> float:
    """Bytes -> GiB rounded down to 0.01 (LMCache reads floats; never round up)."""
    return (max(0, num_bytes) * 100 // GIB) / 100


def lmcache_dict(plan: "TierPlan") -> dict[str, Any]:
    """The LMCache config keys for this plan, in a stable order."""
    data: dict[str, Any] = {
        "chunk_size": plan.chunk_size,
        "local_cpu": plan.cpu.enabled,
        "max_local_cpu_size": gib_2dp_floor(plan.cpu.bytes_per_rank),
    }
    if plan.disk.enabled and plan.disk.path:
        data["local_disk"] = "file://" + plan.disk.path.rstrip("/") + "/"
        data["max_local_disk_size"] = gib_2dp_floor(plan.disk.bytes_per_rank)
    else:
        data["max_local_disk_size"] = 0.0
    if plan.remote_url:
        data["remote_url"] = plan.remote_url
    data["extra_config"] = {"use_odirect": bool(plan.disk.enabled and plan.disk.use_odirect)}
    if plan.engine == "lmi_cache" and plan.cpu.enabled:  # explicit even when 0: the engine's default is on
        data["extra_config"]["session_retention_share"] = plan.cpu.session_retention_share
    if plan.peer is not None:
        data.update(plan.peer.lmcache_keys())
        data["extra_config"]["peer_transport"] = plan.peer.transport
        data["extra_config"]["peer_timeout_ms"] = plan.peer.timeout_ms
        if plan.peer.holders is not None and plan.peer.holders.own:
            data["extra_config"]["peer_holders_url"] = plan.peer.holders.url
    if plan.blend is not None:  # LMCache's own top-level keys, read by LmiCacheConnector
        data.update(plan.blend.to_lmcache_dict())
    return data


def render_yaml(data: dict[str, Any], header: str = "") -> str:
    """YAML text with an optional comment header (yaml imported lazily: start-up speed)."""
    import yaml

    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    return ("\n".join(lines) + "\n" if lines else "") + body

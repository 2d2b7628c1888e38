"""Where each tier setting came from, so every way in is checked by the planner with the same messages.

Used at container start and by ``plan`` / ``validate`` (CLI process). The
planner names a tier setting by its LMI option name (``lmcache_chunk_size=100:
must be ...``); a value can also come from ``OPTION_*``, a flag, an LMCache YAML
or an ``LMCACHE_<KEY>`` variable. ``relabel`` puts the way the user gave it in
that place, so ``LMCACHE_CHUNK_SIZE=100`` and ``option.lmcache_chunk_size=100``
are refused with one message that differs only in the name. Pure.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Mapping

from autoconfig.plan.settings import TierOverrides

if TYPE_CHECKING:
    from autoconfig.plan.types import TierPlan
    from lmi_cache.config.cache_config import CacheConfig

# The planner's name for a tier setting -> (LMCache key, TierOverrides field).
TIER_SETTINGS = {
    "lmcache_chunk_size": ("chunk_size", "chunk_size"),
    "lmcache_max_local_cpu_size": ("max_local_cpu_size", "cpu_size_gib"),
    "lmcache_max_local_disk_size": ("max_local_disk_size", "disk_size_gib"),
    "lmcache_local_disk": ("local_disk", "disk_path"),
    "lmcache_use_odirect": ("extra_config.use_odirect", "use_odirect"),
}
_NAMES = re.compile(r"\b(" + "|".join(sorted(TIER_SETTINGS, key=len, reverse=True)) + r")\b")


# Settings whose planner messages start "<name>=<value>: ..." (the leading name is relabelled).
LEADING_SETTINGS = ("tensor_parallel_degree", "pipeline_parallel_degree", "max_model_len", "gpu_memory_utilization")


def relabel(message: str, labels: Mapping[str, str]) -> str:
    """``message`` with each tier setting that ``labels`` knows (and a leading ``<setting>=``) named as given."""
    head = message.split("=", 1)[0]
    if head in LEADING_SETTINGS and head in labels:
        message = labels[head] + message[len(head):]
    return _NAMES.sub(lambda m: labels.get(m.group(1), m.group(1)), message)


def relabel_plan(plan: "TierPlan", labels: Mapping[str, str]) -> "TierPlan":
    """``plan`` whose warnings and explanation name each tier setting as the user gave it."""
    from dataclasses import replace

    return replace(plan, warnings=[relabel(w, labels) for w in plan.warnings],
                   explanation=[relabel(w, labels) for w in plan.explanation])


def named_setting(message: str) -> str | None:
    """The first planner tier-setting name in ``message`` (which setting a PlanError is about), else None."""
    found = _NAMES.search(message)
    return found.group(1) if found else None


def option_labels(options: Mapping[str, Any]) -> dict[str, str]:
    """Planner name -> how messages name the option (file and line, ``OPTION_*`` variable or flag)."""
    return {name: options[name].where for name in (*TIER_SETTINGS, *LEADING_SETTINGS) if name in options}


def lmcache_labels(data: Mapping[str, Any] | None, source: str, env: Mapping[str, str]) -> dict[str, str]:
    """Planner name -> the ``LMCACHE_<KEY>`` variable, the YAML key in ``source``, or LMCache's default."""
    out = {}
    for name, (key, _) in TIER_SETTINGS.items():
        head, _, inner = key.partition(".")
        var = f"LMCACHE_{head.upper()}"
        if var in env:
            out[name] = f"environment variable {var}" + (f" (key {inner})" if inner else "")
        elif data is not None and head in data:
            out[name] = f"{source}: {key}"
        else:
            out[name] = f"LMCache's default {key}"
    return out


def overrides_of(cfg: "CacheConfig") -> TierOverrides:
    """The tiers an LMCache config asks for, as planner overrides (the planner checks them against the host)."""
    from lmi_cache.config.peer import holder_records

    disk_on = bool(cfg.local_disk) and cfg.max_local_disk_size > 0  # LMCache's reader says when one half is missing
    return TierOverrides(
        cpu_size_gib=cfg.max_local_cpu_size if cfg.local_cpu else 0.0,
        disk_size_gib=cfg.max_local_disk_size if disk_on else 0.0,
        disk_path=cfg.local_disk[0] if disk_on else None,
        chunk_size=cfg.chunk_size,
        use_odirect=cfg.use_odirect if disk_on else None,
        enable_p2p=cfg.enable_p2p or None,
        p2p_host=cfg.p2p_host,
        p2p_init_ports=cfg.p2p_init_ports or None,
        p2p_lookup_ports=cfg.p2p_lookup_ports or None,
        peer_timeout_ms=cfg.peer_timeout_ms if cfg.enable_p2p else None,
        peer_holders=holder_records(cfg.peer_holders_url, cfg.remote_url),
    )

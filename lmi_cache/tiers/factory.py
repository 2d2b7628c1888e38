"""Which tiers a config asks for, built in lookup order (worker process).

Each tier module registers one builder here: ``(config, context) -> Tier |
None`` (None: not configured). Modules are imported only when their builder
runs, so a process without a remote store never imports redis or boto3, and
a new tier is a new module plus one line below.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from lmi_cache.metrics import CacheMetrics, RateLimitedWarner
from lmi_cache.tiers.base import RemoveCallback, Tier
from lmi_cache.tiers.host_memory import HostAllocator

if TYPE_CHECKING:
    from lmi_cache.config import CacheConfig
    from lmi_cache.tiers.cpu_tier import EvictCallback


@dataclass
class TierContext:
    """What every tier builder may use besides the config."""

    rank_label: str
    metrics: CacheMetrics
    warner: RateLimitedWarner
    allocator: HostAllocator
    on_evict: EvictCallback  # the CPU tier's eviction callback (demote-to-disk)
    on_remove: RemoveCallback  # a persistent tier's removal callback (the scheduler's index)


Builder = Callable[["CacheConfig", TierContext], "Tier | None"]

# In lookup order, fastest first: "module:function".
TIER_BUILDERS: list[str] = [
    "lmi_cache.tiers.cpu_tier:build",
    "lmi_cache.tiers.disk_tier:build",
    "lmi_cache.remote.tier:build",
]


def build_tiers(config: CacheConfig, context: TierContext, tiers: list[Tier]) -> None:
    """Append the configured tiers to ``tiers`` in lookup order, each as soon as it is built
    (later tiers' start-up callbacks may consult the earlier ones). On failure, closes what was built."""
    try:
        for target in TIER_BUILDERS:
            module_name, _, function = target.partition(":")
            builder: Builder = getattr(importlib.import_module(module_name), function)
            tier = builder(config, context)
            if tier is not None:
                tiers.append(tier)
    except BaseException:
        for tier in tiers:
            tier.close()
        tiers.clear()
        raise

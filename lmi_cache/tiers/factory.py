"""Which tiers a config asks for, built in lookup order (worker process).

Each tier module has one builder, ``(config, context) -> Tier | None``
(None: not configured), listed below in lookup order. The remote tier imports
its store clients (redis, boto3) only when a ``remote_url`` asks for one, so
listing it here costs a process without a remote store nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.remote import tier as remote_tier
from lmi_cache.tiers import cpu_tier
from lmi_cache.tiers.base import DropCallback, Tier
from lmi_cache.tiers.disk import tier as disk_tier
from lmi_cache.tiers.host_memory import HostAllocator

if TYPE_CHECKING:
    from lmi_cache.config.cache_config import CacheConfig


@dataclass
class TierContext:
    """What every tier builder may use besides the config."""

    rank_label: str
    metrics: CacheMetrics
    warner: RateLimitedWarner
    allocator: HostAllocator
    on_drop: DropCallback  # a persistent tier lost an entry on its own (reported to the placement directory)


Builder = Callable[["CacheConfig", TierContext], "Tier | None"]

# In lookup order, fastest first.
TIER_BUILDERS: tuple[Builder, ...] = (cpu_tier.build, disk_tier.build, remote_tier.build)


def build_tiers(config: CacheConfig, context: TierContext, tiers: list[Tier]) -> None:
    """Append the configured tiers to ``tiers`` in lookup order. On failure, closes what was built."""
    try:
        for builder in TIER_BUILDERS:
            tier = builder(config, context)
            if tier is not None:
                tiers.append(tier)
    except BaseException:
        for tier in tiers:
            tier.close()
        tiers.clear()
        raise

"""Lazy registry of tier classes and the builder the engine uses (worker process).

Tier modules are imported only when a config enables them, so a disk-only or
remote-only process never pays for the others (and redis/boto3 stay optional).
"""
from __future__ import annotations

import importlib
from typing import Any

from lmi_cache.tiers.base import Tier

# name -> "module:Class", in lookup order (fastest first).
TIER_CLASSES: dict[str, str] = {
    "cpu": "lmi_cache.tiers.cpu_tier:CpuTier",
    "disk": "lmi_cache.tiers.disk_tier:DiskTier",
}


def tier_class(name: str) -> type[Tier]:
    try:
        target = TIER_CLASSES[name]
    except KeyError:
        raise KeyError(f"unknown tier {name!r}; known: {', '.join(TIER_CLASSES)}") from None
    module_name, _, class_name = target.partition(":")
    cls: type[Tier] = getattr(importlib.import_module(module_name), class_name)
    return cls


def create_tier(name: str, *args: Any, **kwargs: Any) -> Tier:
    return tier_class(name)(*args, **kwargs)

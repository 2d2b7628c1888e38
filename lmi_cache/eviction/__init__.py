"""Eviction policies for the byte-bounded tiers (torch-free, worker process)."""
from __future__ import annotations

from lmi_cache.eviction.base import EvictionPolicy, make_policy

__all__ = ["EvictionPolicy", "make_policy"]

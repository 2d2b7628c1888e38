"""lmi_cache: the bundled KV-cache engine (tiers, chunk keys, vLLM connector).

Importing this package must stay cheap and torch-free: autoconfig imports
``lmi_cache.config.cache_config`` and ``lmi_cache.kv_layout`` at container start.
"""
from __future__ import annotations

__version__ = "0.1.0"

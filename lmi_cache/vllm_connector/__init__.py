"""vLLM KV connector for lmi_cache (imported by vLLM's scheduler and worker processes).

vLLM loads ``LmiCacheConnector`` from this module path
(``kv_connector_module_path="lmi_cache.vllm_connector"``).
"""
from __future__ import annotations

from lmi_cache.vllm_connector.connector import LmiCacheConnector

__all__ = ["LmiCacheConnector"]

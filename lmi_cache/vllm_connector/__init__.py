"""vLLM KV connector for lmi_cache (imported by vLLM's scheduler and worker processes).

vLLM loads ``LmiCacheConnector`` from this module path
(``kv_connector_module_path="lmi_cache.vllm_connector"``): it imports the
package and reads the attribute, which imports the connector (and vLLM) then.
The package itself stays free of vLLM, so its vLLM-free parts (``key_index``,
``metadata``) import in milliseconds for tools and tests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmi_cache.vllm_connector.connector import LmiCacheConnector

__all__ = ["LmiCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "LmiCacheConnector":
        from lmi_cache.vllm_connector.connector import LmiCacheConnector

        return LmiCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

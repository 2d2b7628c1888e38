"""vLLM glue of lmi_cache: the one package that imports vLLM (vLLM's scheduler and worker processes).

vLLM loads ``LmiCacheConnector`` from this module path
(``kv_connector_module_path="lmi_cache.vllm_connector"``): it imports the
package and reads the attribute, which imports the connector (and vLLM) then.
``LmiBlendConnector`` is the earlier name of the connector with blending on.
The package itself stays free of vLLM, so its vLLM-free part (``metadata``)
imports in milliseconds for tools and tests. Nothing outside this
package imports vLLM (``tests/lmi_cache/test_vllm_imports.py`` checks it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmi_cache.vllm_connector.connector import LmiBlendConnector, LmiCacheConnector

__all__ = ["LmiBlendConnector", "LmiCacheConnector"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lmi_cache.vllm_connector import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

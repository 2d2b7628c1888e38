"""The earlier module path of the blending connector, kept so existing launch arguments work (vLLM processes).

``{"kv_connector": "LmiBlendConnector", "kv_connector_module_path": "lmi_cache.blend.connector"}``
still loads: the name resolves to ``lmi_cache.vllm_connector.LmiBlendConnector``
(the one connector with blending forced on, which logs one deprecation line).
New deployments load ``LmiCacheConnector`` from ``lmi_cache.vllm_connector`` with
``enable_blending: true``. This module imports vLLM only when the name is read.
"""
from __future__ import annotations

from typing import Any

from lmi_cache.blend.settings import load_blend_settings

__all__ = ["LmiBlendConnector", "load_blend_settings"]


def __getattr__(name: str) -> Any:
    if name == "LmiBlendConnector":
        from lmi_cache import vllm_connector

        return vllm_connector.LmiBlendConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

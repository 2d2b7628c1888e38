"""The connector package: vLLM finds the connector by module path and name (the vLLM-free parts: test_vllm_imports)."""
from __future__ import annotations

import importlib

import pytest


@pytest.mark.vllm
def test_vllm_finds_the_connector_by_module_path_and_name() -> None:
    # What vLLM's connector factory does with kv_connector_module_path and kv_connector.
    from lmi_cache.vllm_connector.connector import LmiBlendConnector, LmiCacheConnector

    module = importlib.import_module("lmi_cache.vllm_connector")
    assert getattr(module, "LmiCacheConnector") is LmiCacheConnector
    assert getattr(module, "LmiBlendConnector") is LmiBlendConnector
    # The earlier module path of the blending connector still resolves (to the same class).
    assert getattr(importlib.import_module("lmi_cache.blend.connector"), "LmiBlendConnector") is LmiBlendConnector
    assert issubclass(LmiBlendConnector, LmiCacheConnector) and LmiBlendConnector.force_blending
    # The vLLM-free metadata still satisfies vLLM's abstract bases (registered by the connector module).
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

    from lmi_cache.blend.jobs import BlendConnectorMetadata
    from lmi_cache.vllm_connector.metadata import LmiWorkerMeta

    assert isinstance(BlendConnectorMetadata(), KVConnectorMetadata)
    assert isinstance(LmiWorkerMeta(), KVConnectorWorkerMetadata)
    for path in ("lmi_cache.vllm_connector", "lmi_cache.blend.connector"):
        with pytest.raises(AttributeError):
            getattr(importlib.import_module(path), "NoSuchConnector")

"""Render the vLLM command-line arguments that load the KV connector.

Run by ``plan``/``configure`` (container-start process); ``serve`` appends the
rest of the engine arguments. Our connector is loaded out of tree by module
path (blending is switched by ``enable_blending`` in the YAML); ``--engine lmcache`` targets
upstream LMCache's connector instead.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autoconfig.plan.types import TierPlan
    from autoconfig.plan.settings import ServingSettings

LMI_CACHE_CONNECTOR = {
    "kv_connector": "LmiCacheConnector",
    "kv_connector_module_path": "lmi_cache.vllm_connector",
    "kv_role": "kv_both",
}
# Blending is switched on by enable_blending in the rendered YAML: the same connector loads.
LMI_BLEND_CONNECTOR = LMI_CACHE_CONNECTOR
UPSTREAM_LMCACHE_CONNECTOR = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def kv_transfer_config(engine: str, blend: bool = False) -> dict[str, str]:
    if engine == "lmcache":
        return dict(UPSTREAM_LMCACHE_CONNECTOR)
    return dict(LMI_BLEND_CONNECTOR if blend else LMI_CACHE_CONNECTOR)


def vllm_args(plan: "TierPlan | None", settings: "ServingSettings") -> list[str]:
    """``--kv-transfer-config`` plus the parallel/memory flags the plan assumed (so vLLM matches it).

    ``plan`` is accepted for future plan-dependent flags; today only settings matter.
    """
    args = ["--kv-transfer-config", json.dumps(kv_transfer_config(settings.engine, settings.blend_connector))]
    if settings.tp != 1:
        args += ["--tensor-parallel-size", str(settings.tp)]
    if settings.pp != 1:
        args += ["--pipeline-parallel-size", str(settings.pp)]
    if settings.dp != 1:
        args += ["--data-parallel-size", str(settings.dp)]
    if settings.max_model_len is not None:
        args += ["--max-model-len", str(settings.max_model_len)]
    if settings.gpu_memory_utilization != 0.9:
        args += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    if settings.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", settings.kv_cache_dtype]
    if settings.dtype != "auto":
        args += ["--dtype", settings.dtype]
    return args

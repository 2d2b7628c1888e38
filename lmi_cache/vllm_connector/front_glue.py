"""The front door's vLLM side: hands the checked adapters folder to vLLM, then serves the front middleware.

Runs in vLLM's API server process: ``lmi-cache serve`` passes
``--middleware lmi_cache.vllm_connector.front_glue.LmiFrontMiddleware``, so
vLLM imports this module while it builds the app. Importing it registers a
``LoRAResolver`` for the adapters that passed the checks of
``lmi_cache.front.adapters`` (vLLM loads one the first time a request names
it), and re-exports the middleware. The front
package itself imports no vLLM; this glue package is where vLLM is imported.
"""
from __future__ import annotations

from lmi_cache.front.adapters import Adapter
from lmi_cache.front.middleware import ADAPTERS, LmiFrontMiddleware

__all__ = ["LmiFrontMiddleware", "register_adapters"]
RESOLVER_NAME = "lmi-cache adapters"


def register_adapters(adapters: dict[str, Adapter]) -> None:
    """Let vLLM resolve the folder's good adapters by name on first use (loaded lazily by the engine)."""
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

    good = {a.name: a for a in adapters.values() if a.ok}
    if not good or RESOLVER_NAME in LoRAResolverRegistry.get_supported_resolvers():
        return
    ids = {name: 1 + i for i, name in enumerate(sorted(good))}

    class LmiAdaptersResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
            adapter = good.get(lora_name)
            if adapter is None:
                return None
            # vLLM replaces the id with its own counter; a stable one keeps logs readable.
            return LoRARequest(lora_name=lora_name, lora_int_id=ids[lora_name], lora_path=str(adapter.path))

    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, LmiAdaptersResolver())


register_adapters(ADAPTERS)

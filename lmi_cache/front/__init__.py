"""The SageMaker/LMI front door of ``lmi-cache serve``.

Runs inside vLLM's API server process as an ASGI middleware
(``--middleware lmi_cache.vllm_connector.front_glue.LmiFrontMiddleware``,
added by ``lmi-cache serve``; the glue module registers the adapters folder
with vLLM and re-exports ``middleware.LmiFrontMiddleware``): LMI's
``{"inputs", "parameters", "stream"}`` schema on ``/invocations``, both
spellings of the stateful-session headers, LMI's adapter selection
(``"adapters"`` field, adapters folder registered at start), per-adapter
``model.py`` formatters (``formatters``, opt-in), LMI-shaped errors, and the
bounds that keep careless or hostile clients from hurting the server
(``guard``: body limit, JSON depth, client errors; ``session_store``:
session cap, expiry, start-up folder check; ``adapter_routes``: runtime
adapter routes off or confined). Sessions themselves are AWS's
``model_hosting_container_standards`` library that vLLM already wires in.

The package speaks HTTP and imports no vLLM (a test checks it), so that
``serve`` can use ``options`` before vLLM is imported and tests drive the
middleware in process.
"""

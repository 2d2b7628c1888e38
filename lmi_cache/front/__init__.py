"""The SageMaker/LMI front door of ``lmi-cache serve``.

Runs inside vLLM's OpenAI API server process as an ASGI middleware
(``--middleware lmi_cache.front.middleware.LmiFrontMiddleware``, added by
``lmi-cache serve``): LMI's ``{"inputs", "parameters", "stream"}`` schema on
``/invocations``, both spellings of the stateful-session headers, LMI's
adapter selection (``"adapters"`` field, adapters folder registered at start),
per-adapter ``model.py`` formatters (``formatters``, opt-in) and LMI-shaped
errors. Sessions themselves are AWS's
``model_hosting_container_standards`` library that vLLM already wires in; the
front only adapts its edges to what LMI documents.

``options`` and ``schema`` are pure (no vLLM, no Starlette) so that ``serve``
can use them before vLLM is imported and tests can drive them directly.
"""

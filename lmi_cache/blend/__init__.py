"""CacheBlend-style reuse of cached KV at non-prefix positions: segments, RoPE re-rotation, selection, blending.

The algorithm (``blender``, ``rope``, ``selection``, ``attention``) runs on plain
tensors, for the reference blender over Hugging Face models (``hf_adapter``,
``quality``, ``recall_task``) and inside vLLM through the connector's blending
component (``lmi_cache.vllm_connector.blending``), which drives this package's
scheduler half (``scheduler_plan``, ``jobs``) and worker half (``worker_jobs``,
``paged_kv``, ``engine_io``). Nothing here imports vLLM: the parts that touch
it (the model adapter, vLLM's CPU attention kernel, the model-loader plugin)
live in ``lmi_cache.vllm_connector``. ``settings`` and ``segments`` are torch-free.
"""

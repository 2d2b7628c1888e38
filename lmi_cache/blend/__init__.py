"""CacheBlend-style reuse of cached KV at non-prefix positions: segments, RoPE re-rotation, selection, blending.

The algorithm (``blender``, ``rope``, ``selection``, ``attention``) runs on plain
tensors, for the reference blender over Hugging Face models (``hf_adapter``,
``quality``, ``recall_task``) and inside vLLM: ``connector.LmiBlendConnector``
(scheduler: ``scheduler_plan``, ``jobs``; worker: ``worker_jobs``,
``vllm_model``, ``paged_kv``, ``cpu_paged_attention``, ``engine_io``) with the
model reached through ``vllm_plugin``. ``settings`` and ``segments`` are
torch-free; the vLLM modules import vLLM.
"""

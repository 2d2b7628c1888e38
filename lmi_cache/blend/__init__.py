"""CacheBlend-style reuse of cached KV at non-prefix positions: segments, RoPE re-rotation, selection, blending.

Imported by the reference blender, the quality benchmarks and (later) the
vLLM connector's worker side. ``settings`` and ``segments`` are torch-free;
the other modules need torch. See ``blender`` for the algorithm.
"""

"""Segment KV in and out of the worker's ``CacheEngine`` (vLLM worker process).

A segment's KV is one engine object: ``[layers, 2, T, kv_heads, head_dim]`` in
the KV-cache dtype under the segment's key. The engine's serving verbs are
``save_many(keys, shape, dtype, fill)`` and ``load(keys)`` (batches of
``(position, ChunkObject)`` that must be released); earlier engines had
``store_from`` / ``retrieve``. Both are spoken here, so blending does not
break while the engine's verbs settle.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def save_segment(engine: Any, key: Any, shape: tuple[int, ...], dtype: torch.dtype,
                 fill: Callable[[torch.Tensor], None]) -> bool:
    """Store one segment; ``fill(out)`` writes it into engine memory. True when some tier holds it."""
    if hasattr(engine, "save_many"):
        return bool(engine.save_many([key], shape, dtype, lambda outs: fill(outs[0]))[0])
    return bool(engine.store_from(key, shape, dtype, fill))


def load_segments(engine: Any, keys: Sequence[Any]) -> list[torch.Tensor | None]:
    """Copies of the stored segments (None for a miss), in ``keys`` order."""
    if not hasattr(engine, "load"):
        return [engine.retrieve(key) for key in keys]
    found: list[torch.Tensor | None] = [None] * len(keys)
    for batch in engine.load(list(keys)):
        for position, obj in batch:
            try:
                found[position] = obj.payload_tensor().clone()
            finally:
                obj.release()
    return found

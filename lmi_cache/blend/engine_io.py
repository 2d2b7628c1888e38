"""Segment KV in and out of the worker's engine (vLLM worker process).

A segment's KV is one engine object: ``[layers, 2, T, kv_heads, head_dim]`` in
the KV-cache dtype under the segment's key, stored and loaded with the same
verbs as prefix chunks (``lmi_cache.engine.Engine``: ``save_many`` and ``load``,
whose objects must be released), into the tiers and from the sources the
placement directory named (``blend.jobs``: ``SegmentStore.tiers``,
``BlendPiece.source``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmi_cache.keys.hashing import ChunkKey
    from lmi_cache.engine import Engine


def save_segment(engine: Engine, key: ChunkKey, shape: tuple[int, ...], dtype: torch.dtype,
                 fill: Callable[[torch.Tensor], None], tiers: Sequence[str]) -> bool:
    """Store one segment into ``tiers``; ``fill(out)`` writes it into engine memory. True when some tier holds it."""
    return bool(engine.save_many([key], shape, dtype, lambda outs: fill(outs[0]), [tuple(tiers)])[0])


def load_segments(engine: Engine, keys: Sequence[ChunkKey], sources: Sequence[str],
                  promote: Sequence[bool]) -> list[torch.Tensor | None]:
    """Copies of the stored segments (None for a miss), in ``keys`` order, each from its source tier."""
    found: list[torch.Tensor | None] = [None] * len(keys)
    for batch in engine.load(list(keys), list(sources), list(promote)):
        for position, obj in batch:
            try:
                found[position] = obj.payload_tensor().clone()
            finally:
                obj.release()
    return found

"""Test-side spellings of one-chunk operations, built only on the engine's serving verbs.

The engine exposes what the vLLM connector uses (``save_many``, ``load``,
``tiers``); tests that want "store this tensor" or "is it there" say it with
these helpers, so they exercise exactly the serving path.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, chunk_keys
from lmi_cache.engine import CacheEngine


def keys_for(engine: CacheEngine, tokens: Sequence[int] | np.ndarray, namespace: KeyNamespace) -> list[ChunkKey]:
    config = engine.config
    return chunk_keys(tokens, namespace, config.chunk_size, include_partial=config.save_unfull_chunk)


def save(engine: CacheEngine, key: ChunkKey, data: torch.Tensor) -> bool:
    """Save one chunk (copied into the engine) through ``save_many``."""
    return engine.save_many([key], tuple(data.shape), data.dtype, lambda outs: outs[0].copy_(data))[0]


def load(engine: CacheEngine, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """One chunk through ``load``: a copy (into ``out`` when given), or None on a miss."""
    return load_many(engine, [key], [out])[0]


def load_many(engine: CacheEngine, keys: Sequence[ChunkKey],
              outs: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
    results: list[torch.Tensor | None] = [None] * len(keys)
    targets = list(outs) if outs is not None else [None] * len(keys)
    for batch in engine.load(keys):
        for position, obj in batch:
            try:
                payload = obj.payload_tensor()
                target = targets[position]
                results[position] = target.copy_(payload) if target is not None else payload.clone()
            finally:
                obj.release()
    return results


def held_by(engine: CacheEngine, key: ChunkKey) -> str | None:
    """The name of the first local tier that holds ``key``."""
    return next((tier.name for tier in engine.tiers if tier.local and tier.contains(key.digest)), None)


def lookup(engine: CacheEngine, keys: Sequence[ChunkKey]) -> int:
    """Tokens of the longest prefix of ``keys`` held by some local tier (``min_retrieve_tokens`` applies)."""
    hit = 0
    for key in keys:
        if held_by(engine, key) is None:
            break
        hit = key.end
    return hit if hit >= engine.config.min_retrieve_tokens else 0


def lookup_tokens(engine: CacheEngine, tokens: Sequence[int] | np.ndarray, namespace: KeyNamespace) -> int:
    return lookup(engine, keys_for(engine, tokens, namespace))


def tier(engine: CacheEngine, name: str):  # type: ignore[no-untyped-def]
    return next(t for t in engine.tiers if t.name == name)

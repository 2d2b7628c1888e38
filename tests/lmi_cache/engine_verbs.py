"""Test-side spellings of one-chunk operations, built only on the engine's serving verbs.

The engine exposes what the vLLM connector uses (``save_many``, ``load``,
``tiers``); tests that want "store this tensor" or "is it there" say it with
these helpers, so they exercise exactly the serving path. The engine has no
undirected mode (the placement directory names every tier), so the helpers
name them as a directory would: a save into every tier unless told, a load
from the first tier holding the chunk (the remote store when none does),
promoted into the CPU tier when it comes from behind it.
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


def all_tiers(engine: CacheEngine) -> tuple[str, ...]:
    """Every tier of ``engine`` by its name in the directory's instructions."""
    return tuple(tier.name if tier.local else "remote" for tier in engine.tiers)


def save(engine: CacheEngine, key: ChunkKey, data: torch.Tensor, tiers: Sequence[str] | None = None) -> bool:
    """Save one chunk (copied into the engine) through ``save_many``, into ``tiers`` (default: every tier)."""
    names = tuple(tiers) if tiers is not None else all_tiers(engine)
    return engine.save_many([key], tuple(data.shape), data.dtype, lambda outs: outs[0].copy_(data), [names])[0]


def sources_for(engine: CacheEngine, keys: Sequence[ChunkKey]) -> tuple[list[str], list[bool]]:
    """Each key's source as a directory would name it (the first local tier holding it, else the remote store)
    and whether it is promoted into the first tier."""
    first = engine.tiers[0].name if engine.tiers else ""
    sources = [held_by(engine, key) or "remote" for key in keys]
    return sources, [source != first for source in sources]


def load(engine: CacheEngine, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """One chunk through ``load``: a copy (into ``out`` when given), or None on a miss."""
    return load_many(engine, [key], [out])[0]


def load_many(engine: CacheEngine, keys: Sequence[ChunkKey],
              outs: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
    results: list[torch.Tensor | None] = [None] * len(keys)
    targets = list(outs) if outs is not None else [None] * len(keys)
    sources, promote = sources_for(engine, keys)
    for batch in engine.load(keys, sources, promote):
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

"""Token ids -> prefix-chained 128-bit chunk keys (torch-free; scheduler and worker processes).

A chunk's digest is XXH3-128 over (previous chunk's digest, this chunk's token
ids as uint32 little-endian); the first chunk chains from the namespace seed,
so keys of different models (and of different weights at the same path: see
``model_identity``), KV dtypes, layouts, ranks, LoRA adapters or
``cache_salt`` values never meet. Nothing depends on PYTHONHASHSEED: the same
tokens give the same keys in every process on every machine.

Each key also carries a fingerprint: a second, independent chain (XXH64) over
the same input. Stored chunks record it and loads compare it, so a digest
collision turns into a counted miss instead of someone else's KV.
"""
from __future__ import annotations

import array
import json
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import xxhash

# Bump when the key derivation changes: old persisted chunks then stop matching.
KEY_SCHEME_VERSION = "lmi-cache-keys-v2"  # v2: the namespace holds the weights' identity
_FINGERPRINT_SEED = 0x6C6D692D66707631  # "lmi-fpv1": any fixed constant, never changed


@dataclass(frozen=True)
class KeyNamespace:
    """Everything besides the tokens that decides whether two chunks hold the same KV."""

    model: str  # the model as vLLM names it (path or hub id)
    kv_dtype: str  # KV-cache dtype, e.g. "bfloat16"
    layout: str  # version tag of the chunk byte layout, e.g. "cpu-lbhnc-v1"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    lora: str | None = None  # LoRA adapter identity; None = base model
    cache_salt: str | None = None  # vLLM's per-request cache_salt (tenant isolation)
    model_identity: str = ""  # what the weights are (model_identity.model_identity): changes with them

    def seed(self) -> bytes:
        """16 bytes derived from every field (canonical JSON, so stable across processes)."""
        canonical = json.dumps([KEY_SCHEME_VERSION, asdict(self)], sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_digest(canonical.encode("utf-8"))


@dataclass(frozen=True)
class ChunkKey:
    """The key of one chunk: tokens [start, end) of a prompt under one namespace."""

    digest: bytes  # 16 bytes, prefix-chained XXH3-128
    start: int
    end: int
    fingerprint: int  # independent 64-bit chain over the same tokens, checked on load

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> memoryview:
    """Token ids as uint32 little-endian bytes; ValueError for ids outside [0, 2**32)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
            raise ValueError("token ids must be in [0, 2**32)")
        return np.ascontiguousarray(tokens, dtype="<u4").data.cast("B")
    try:
        # array.array from a list is ~5x faster than numpy for 128k Python ints.
        packed = array.array("I", tokens)
    except (OverflowError, TypeError) as err:
        raise ValueError(f"token ids must be integers in [0, 2**32): {err}") from None
    if packed.itemsize != 4:  # pragma: no cover - no supported platform has a 2-byte unsigned int
        packed = array.array("L", tokens)
    if sys.byteorder != "little":  # pragma: no cover - x86 and arm64 are little-endian
        packed.byteswap()
    return memoryview(packed).cast("B")


def chunk_keys(
    tokens: Sequence[int] | np.ndarray,
    namespace: KeyNamespace,
    chunk_size: int,
    include_partial: bool = False,
) -> list[ChunkKey]:
    """Keys of consecutive chunks of ``tokens``; a trailing partial chunk only if asked."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    data = _token_bytes(tokens)
    num_tokens = len(data) // 4
    end_full = num_tokens - num_tokens % chunk_size
    stop = num_tokens if include_partial else end_full
    keys: list[ChunkKey] = []
    prev = namespace.seed()
    prev_fp = prev
    xxh3_128 = xxhash.xxh3_128
    xxh64 = xxhash.xxh64
    for start in range(0, stop, chunk_size):
        end = min(start + chunk_size, stop)
        body = data[start * 4 : end * 4]
        digest_state = xxh3_128(prev)
        digest_state.update(body)
        fp_state = xxh64(prev_fp, seed=_FINGERPRINT_SEED)
        fp_state.update(body)
        prev = digest_state.digest()
        fingerprint = fp_state.intdigest()
        prev_fp = fingerprint.to_bytes(8, "little")
        keys.append(ChunkKey(prev, start, end, fingerprint))
    return keys

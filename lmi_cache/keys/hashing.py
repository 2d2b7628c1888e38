"""Token ids -> prefix-chained 128-bit chunk keys (torch-free; scheduler and worker processes).

A chunk's chain digest is XXH3-128 over (previous chunk's digest, this chunk's
token ids as uint32 little-endian); the first chunk chains from a namespace
seed, so keys of different models (and of different weights at the same path:
see ``model_identity``), KV dtypes, layouts, LoRA adapters or ``cache_salt``
values never meet. Nothing depends on PYTHONHASHSEED: the same tokens give the
same keys in every process on every machine.

A chunk that holds more than token ids (an image's placeholders, prompt
embeddings: ``key_inputs.KeyInputs.chunk_extra``) folds 16 more bytes into its
link, hashed under other seeds so that such a link does not meet a token-only
one (the input lengths alone could otherwise line up). What a key covers besides the tokens is decided in ``key_inputs``.

Each key also carries a fingerprint: a second, independent chain (XXH64) over
the same input. Stored chunks record it and loads compare it, so a digest
collision turns into a counted miss instead of someone else's KV.

:class:`KeySpace` is what serving uses: the scheduler needs every rank's key
of every chunk, and the ranks differ only in which slice of the KV they hold,
so a prompt is chained once per request and each rank's key is derived from
the chain by one short hash of (rank seed, chain digest). The older
:class:`KeyNamespace` / :func:`chunk_keys` pair chains once per rank (the rank
is in the seed); it stays for callers that hold one rank's namespace.
"""
from __future__ import annotations

import array
import json
import sys
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import xxhash

if TYPE_CHECKING:
    from lmi_cache.keys.key_inputs import KeyInputs

# Bump when the key derivation changes: old persisted chunks then stop matching.
# v2: the namespace holds the weights' identity. v3: one chain per request, per-rank keys derived from it.
# v4: multimodal items, prompt embeddings and the adapter's content are keyed (v3 keyed an image's
# placeholders as text, so a v3 chunk may hold one image's KV under keys a text prompt can reach).
KEY_SCHEME_VERSION = "lmi-cache-keys-v4"
_FINGERPRINT_SEED = 0x6C6D692D66707631  # "lmi-fpv1": any fixed constant, never changed
# Seeds of links that carry extra bytes besides token ids (fixed constants, never changed).
_EXTRA_DIGEST_SEED = 0x6C6D692D78747231  # "lmi-xtr1"
_EXTRA_FINGERPRINT_SEED = 0x6C6D692D78667031  # "lmi-xfp1"

# The chunk [start, end)'s bytes besides its token ids (b"": none); see key_inputs.KeyInputs.chunk_extra.
ChunkExtra = Callable[[int, int], bytes]


@dataclass(frozen=True)
class KeyNamespace:
    """Everything besides the tokens that decides whether two chunks hold the same KV."""

    model: str  # the model as vLLM names it (path or hub id)
    kv_dtype: str  # KV-cache dtype, e.g. "bfloat16"
    layout: str  # KV layout tag from transfer.layouts (kind.stride-order.dtype), e.g. "cpu.s0123.bfloat16"
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


def _chain(data: memoryview, seed: bytes, chunk_size: int, include_partial: bool,
           extra: ChunkExtra | None = None) -> list[tuple[int, int, bytes, int]]:
    """(start, end, chain digest, chain fingerprint) of consecutive chunks of ``data`` (uint32 token bytes)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    num_tokens = len(data) // 4
    stop = num_tokens if include_partial else num_tokens - num_tokens % chunk_size
    links: list[tuple[int, int, bytes, int]] = []
    prev = prev_fp = seed
    digest_of, fingerprint_of = xxhash.xxh3_128_digest, xxhash.xxh64_intdigest
    for start in range(0, stop, chunk_size):
        end = min(start + chunk_size, stop)
        body = data[start * 4 : end * 4]
        more = extra(start, end) if extra is not None else b""
        if more:  # other seeds: a link with extra bytes does not meet a token-only link of other tokens
            prev = digest_of(prev + body + more, _EXTRA_DIGEST_SEED)
            fingerprint = fingerprint_of(prev_fp + body + more, _EXTRA_FINGERPRINT_SEED)
        else:
            # One-shot hashes of (previous link || body): the same values as streaming, without a state object per chunk.
            prev = digest_of(prev + body)
            fingerprint = fingerprint_of(prev_fp + body, _FINGERPRINT_SEED)
        prev_fp = fingerprint.to_bytes(8, "little")
        links.append((start, end, prev, fingerprint))
    return links


def chunk_keys(
    tokens: Sequence[int] | np.ndarray,
    namespace: KeyNamespace,
    chunk_size: int,
    include_partial: bool = False,
) -> list[ChunkKey]:
    """Keys of consecutive chunks of ``tokens`` in one rank's namespace; a trailing partial chunk only if asked."""
    links = _chain(_token_bytes(tokens), namespace.seed(), chunk_size, include_partial)
    return [ChunkKey(digest, start, end, fingerprint) for start, end, digest, fingerprint in links]


def _canonical_digest(*parts: object) -> bytes:
    return xxhash.xxh3_128_digest(json.dumps([KEY_SCHEME_VERSION, *parts], sort_keys=True, separators=(",", ":")).encode())


@dataclass(frozen=True)
class RequestKeys:
    """Every rank's key of every chunk of one prompt: ``per_chunk[c][r]`` (rank = pp_rank * tp_size + tp_rank)."""

    per_chunk: tuple[tuple[ChunkKey, ...], ...]

    def __len__(self) -> int:
        return len(self.per_chunk)

    def rank(self, rank: int) -> list[ChunkKey]:
        """One rank's keys, in chunk order."""
        return [keys[rank] for keys in self.per_chunk]


@dataclass(frozen=True)
class KeySpace:
    """The rank-independent part of a deployment's key namespace; derives every rank's chunk keys.

    Built once per served model and KV layout (the scheduler builds it when the
    workers report their layout tag). A request adds its LoRA adapter and
    ``cache_salt``; ranks are told apart in the last step only, so a prompt is
    hashed once however many ranks there are.
    """

    model: str  # the model as vLLM names it (path or hub id)
    kv_dtype: str  # KV-cache dtype, e.g. "bfloat16"
    layout: str  # KV layout tag from transfer.layouts, e.g. "cpu.s0123.bfloat16"
    chunk_size: int  # tokens per chunk
    tp_size: int = 1
    pp_size: int = 1
    model_identity: str = ""  # what the weights are (model_identity.model_identity): changes with them
    # vLLM KV cache group the chunks hold (kv_groups.KvCacheGroup.key_tag); "" for a model whose layers
    # all form one full-attention group, so its keys are those written before groups were named.
    kv_group: str = ""

    def __post_init__(self) -> None:
        for name in ("chunk_size", "tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KeySpace.{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @cached_property
    def _rank_seeds(self) -> tuple[bytes, ...]:
        # The rank seed holds only the rank: the chain it is combined with already holds the namespace.
        return tuple(_canonical_digest("rank", rank % self.tp_size, rank // self.tp_size)
                     for rank in range(self.world_size))

    def request_seed(self, lora: str | None = None, cache_salt: str | None = None) -> bytes:
        """16 bytes derived from every field plus the request's adapter and salt (canonical JSON)."""
        fields = asdict(self)
        if not fields["kv_group"]:
            del fields["kv_group"]  # keys of single-group models stay what they were
        return _canonical_digest("request", fields, lora, cache_salt)

    def _links(self, tokens: Sequence[int] | np.ndarray, lora: str | None, cache_salt: str | None,
               include_partial: bool, extra: ChunkExtra | None = None) -> list[tuple[int, int, bytes, int]]:
        return _chain(_token_bytes(tokens), self.request_seed(lora, cache_salt), self.chunk_size, include_partial,
                      extra)

    def for_inputs(self, inputs: KeyInputs, include_partial: bool = False) -> RequestKeys:
        """Every rank's key of every chunk of a request's key inputs (``key_inputs``): its tokens, multimodal
        items, embeddings, adapter and salt; no keys for a request those cannot name safely."""
        if inputs.uncacheable is not None:
            return RequestKeys(())
        extra = None if inputs.is_plain_text else inputs.chunk_extra
        return self.for_request(inputs.tokens, inputs.adapter, inputs.cache_salt, include_partial, extra)

    def for_request(self, tokens: Sequence[int] | np.ndarray, lora: str | None = None, cache_salt: str | None = None,
                    include_partial: bool = False, extra: ChunkExtra | None = None) -> RequestKeys:
        """Every rank's key of every full chunk (and the trailing partial one if asked), hashing ``tokens`` once.

        ``lora`` is the adapter's identity string; ``extra`` what each chunk holds besides its tokens."""
        seeds = self._rank_seeds
        digest_of, fingerprint_of = xxhash.xxh3_128_digest, xxhash.xxh64_intdigest
        per_chunk = []
        for start, end, digest, fingerprint in self._links(tokens, lora, cache_salt, include_partial, extra):
            fp_bytes = fingerprint.to_bytes(8, "little")
            per_chunk.append(tuple(
                ChunkKey(digest_of(seed + digest), start, end, fingerprint_of(seed + fp_bytes, _FINGERPRINT_SEED))
                for seed in seeds
            ))
        return RequestKeys(tuple(per_chunk))

    def keys(self, tokens: Sequence[int] | np.ndarray, rank: int, lora: str | None = None,
             cache_salt: str | None = None, include_partial: bool = False) -> list[ChunkKey]:
        """One rank's keys: equal to ``for_request(...).rank(rank)``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this key space's {self.world_size} ranks")
        seed = self._rank_seeds[rank]
        digest_of, fingerprint_of = xxhash.xxh3_128_digest, xxhash.xxh64_intdigest
        return [
            ChunkKey(digest_of(seed + digest), start, end,
                     fingerprint_of(seed + fingerprint.to_bytes(8, "little"), _FINGERPRINT_SEED))
            for start, end, digest, fingerprint in self._links(tokens, lora, cache_salt, include_partial)
        ]

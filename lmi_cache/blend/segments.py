"""Prompt segments for blending: split token ids at a separator, and key a segment by its own tokens.

Torch-free; runs on the scheduler side (planning which segments to load) and
on the worker side (keys of segments to store). A prompt
``[s_1 SEP s_2 SEP ... s_m SEP tail]`` splits into segments that each end
with their separator (so a document's segment is the same wherever it
appears) and a tail after the last separator, which is never blended (the
question, prefilled normally).

A segment's key depends on the namespace (model, weights, KV dtype, layout,
ranks, LoRA, cache_salt) and its tokens alone, never on where it sits in a
prompt. It is derived under its own scheme tag, so a segment key can never
equal a prefix chunk key of ``keys.hashing`` (see ``segment_key``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import xxhash

from lmi_cache.keys.hashing import KeyNamespace, _token_bytes

# Bump when the segment key derivation changes. Its length is 23 bytes, not a
# multiple of 4: a segment key's hash input (16-byte seed + tag + 4-byte token
# ids) therefore never has the length of a chunk key's input (16-byte seed +
# 4-byte token ids), so the two can never hash the same bytes.
SEGMENT_SCHEME_TAG = b"lmi-cache-segment-key-1"
_SEGMENT_FINGERPRINT_SEED = 0x6C6D692D73656731  # "lmi-seg1": fixed, never changed


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of a prompt."""

    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SegmentSplit:
    """Segments (each ending with its separator) and the tail after the last separator."""

    segments: tuple[Span, ...]
    tail: Span


@dataclass(frozen=True)
class SegmentKey:
    """The key of one segment's KV, computed as if the segment started at position 0."""

    digest: bytes  # 16 bytes, XXH3-128
    fingerprint: int  # independent XXH64 over the same input, checked on load
    num_tokens: int

    @property
    def hex(self) -> str:
        return self.digest.hex()


def separator_ids(encode: Callable[[str], Sequence[int]], special_str: str) -> tuple[int, ...]:
    """The separator's token ids as ``encode`` (a tokenizer without special tokens) gives them.

    A separator only splits a prompt where the prompt's token ids contain exactly
    these ids; build prompts by concatenating token ids (or pick a separator that
    tokenizes the same in context, such as LMCache's default " # # ").
    """
    ids = tuple(int(i) for i in encode(special_str))
    if not ids:
        raise ValueError(f"blend_special_str {special_str!r} encodes to no tokens")
    return ids


def split_segments(tokens: Sequence[int] | np.ndarray, sep_ids: Sequence[int]) -> SegmentSplit:
    """Split at each non-overlapping occurrence of ``sep_ids``, scanning left to right."""
    if not sep_ids:
        raise ValueError("separator token ids must not be empty")
    arr = np.asarray(tokens, dtype=np.int64)
    sep = np.asarray(sep_ids, dtype=np.int64)
    n, m = arr.size, sep.size
    segments: list[Span] = []
    start = 0
    if n >= m:
        # Candidate match starts: positions where the first separator id occurs.
        candidates = np.flatnonzero(arr[: n - m + 1] == sep[0])
        next_free = 0
        for pos in candidates.tolist():
            if pos < next_free:
                continue
            if m == 1 or np.array_equal(arr[pos : pos + m], sep):
                end = pos + m
                segments.append(Span(start, end))
                start = next_free = end
    return SegmentSplit(tuple(segments), Span(start, n))


def segment_key(tokens: Sequence[int] | np.ndarray, namespace: KeyNamespace) -> SegmentKey:
    """Key of a segment's KV: namespace and the segment's own tokens, position excluded."""
    body = _token_bytes(tokens)
    seed = namespace.seed()
    digest = xxhash.xxh3_128(seed)
    digest.update(SEGMENT_SCHEME_TAG)
    digest.update(body)
    fingerprint = xxhash.xxh64(seed, seed=_SEGMENT_FINGERPRINT_SEED)
    fingerprint.update(SEGMENT_SCHEME_TAG)
    fingerprint.update(body)
    return SegmentKey(digest.digest(), fingerprint.intdigest(), len(body) // 4)


@dataclass(frozen=True)
class BlendPlan:
    """What one request blends: after ``prefix_tokens`` exact tokens, ``pieces`` then the tail.

    Each piece is a span with a flag saying whether its segment KV is cached; uncached
    pieces (a segment not in the store, or the part of a segment the exact prefix hit
    cut into) are computed in full by the blender. The tail is prefilled normally.
    """

    prefix_tokens: int
    pieces: tuple[tuple[Span, bool], ...]
    tail: Span

    @property
    def blended_tokens(self) -> int:
        """Tokens whose KV comes from the segment cache."""
        return sum(span.num_tokens for span, hit in self.pieces if hit)


def plan_blend(
    split: SegmentSplit, prefix_hit_tokens: int, segment_cached: Sequence[bool], min_tokens: int
) -> BlendPlan | None:
    """The blend for a request whose first ``prefix_hit_tokens`` are an exact prefix hit, or None.

    None when fewer than ``min_tokens`` (``blend_min_tokens``) tokens would come from cached
    segments: such a request is served by the prefix path alone. Uncached segments after the
    last cached one join the tail (blending them would only cost a pass).
    """
    if len(segment_cached) != len(split.segments):
        raise ValueError("one cached flag per segment")
    pieces: list[tuple[Span, bool]] = []
    for span, hit in zip(split.segments, segment_cached):
        if span.end <= prefix_hit_tokens:
            continue
        if span.start < prefix_hit_tokens:
            pieces.append((Span(prefix_hit_tokens, span.end), False))
        else:
            pieces.append((span, bool(hit)))
    while pieces and not pieces[-1][1]:
        pieces.pop()
    if not pieces:
        return None
    plan = BlendPlan(prefix_hit_tokens, tuple(pieces), Span(pieces[-1][0].end, split.tail.end))
    if plan.blended_tokens == 0 or plan.blended_tokens < min_tokens:
        return None
    return plan

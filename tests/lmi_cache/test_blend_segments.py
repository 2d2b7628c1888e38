"""Segments: splitting at separator token ids, and segment keys (own tokens only, never a chunk key)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmi_cache.blend.segments import Span, plan_blend, segment_key, separator_ids, split_segments
from lmi_cache.keys.hashing import KeyNamespace, chunk_keys

NS = KeyNamespace(model="m", kv_dtype="float32", layout="cpu-v1")


def test_split_each_segment_ends_with_its_separator() -> None:
    split = split_segments([5, 6, 9, 9, 7, 9, 9, 8, 1], [9, 9])
    assert split.segments == (Span(0, 4), Span(4, 7))
    assert split.tail == Span(7, 9)


def test_no_separator_is_all_tail() -> None:
    split = split_segments([1, 2, 3], [9])
    assert split.segments == () and split.tail == Span(0, 3)
    assert split_segments([], [9]).tail == Span(0, 0)


def test_overlapping_matches_scan_left_to_right() -> None:
    split = split_segments([9, 9, 9, 1], [9, 9])
    assert split.segments == (Span(0, 2),)
    assert split.tail == Span(2, 4)


def test_separator_at_the_end_leaves_an_empty_tail() -> None:
    split = split_segments(np.array([1, 9, 2, 9]), [9])
    assert split.segments == (Span(0, 2), Span(2, 4)) and split.tail.num_tokens == 0


@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(0, 3), min_size=1, max_size=3))
def test_split_covers_the_prompt_and_segments_end_in_separators(tokens: list[int], sep: list[int]) -> None:
    split = split_segments(tokens, sep)
    pos = 0
    for span in split.segments:
        assert span.start == pos and tokens[span.end - len(sep) : span.end] == sep
        pos = span.end
    assert split.tail == Span(pos, len(tokens))
    # The tail holds no complete separator.
    tail = tokens[pos:]
    assert not any(tail[i : i + len(sep)] == sep for i in range(len(tail) - len(sep) + 1))


def test_separator_ids_uses_the_encoder() -> None:
    assert separator_ids(lambda text: [ord(c) for c in text], " # ") == (32, 35, 32)
    with pytest.raises(ValueError, match="no tokens"):
        separator_ids(lambda text: [], " # # ")


def test_segment_key_depends_on_tokens_and_namespace_only() -> None:
    key = segment_key([10, 11, 12], NS)
    assert key == segment_key(np.array([10, 11, 12]), NS)
    assert key.num_tokens == 3 and len(key.digest) == 16
    assert segment_key([10, 11, 13], NS).digest != key.digest
    assert segment_key([10, 11, 12], KeyNamespace("m", "float32", "cpu-v1", cache_salt="t")).digest != key.digest
    assert segment_key([10, 11, 12], KeyNamespace("other", "float32", "cpu-v1")).digest != key.digest


def test_segment_key_is_never_a_chunk_key() -> None:
    tokens = list(range(100, 116))
    seg = segment_key(tokens, NS)
    chunk_digests = {k.digest for size in (1, 4, 16) for k in chunk_keys(tokens, NS, size, include_partial=True)}
    assert seg.digest not in chunk_digests
    assert seg.fingerprint not in {k.fingerprint for k in chunk_keys(tokens, NS, 16)}


def test_plan_blend_after_a_prefix_hit() -> None:
    split = split_segments([1, 2, 9, 3, 4, 9, 5, 6, 9, 7, 8, 9, 0], [9])  # segments of 3 tokens, tail [0]
    plan = plan_blend(split, prefix_hit_tokens=3, segment_cached=[True, True, False, True], min_tokens=4)
    assert plan is not None
    assert plan.prefix_tokens == 3
    assert plan.pieces == ((Span(3, 6), True), (Span(6, 9), False), (Span(9, 12), True))
    assert plan.tail == Span(12, 13) and plan.blended_tokens == 6


def test_plan_blend_cut_segment_and_trailing_misses() -> None:
    split = split_segments([1, 2, 9, 3, 4, 9, 5, 6, 9, 0], [9])
    plan = plan_blend(split, prefix_hit_tokens=4, segment_cached=[True, True, True, False][:3], min_tokens=0)
    assert plan is not None
    assert plan.pieces == ((Span(4, 6), False), (Span(6, 9), True))
    split2 = split_segments([1, 9, 2, 9, 3, 9, 0], [9])
    plan2 = plan_blend(split2, 0, [True, False, False], min_tokens=0)
    assert plan2 is not None and plan2.pieces == ((Span(0, 2), True),) and plan2.tail == Span(2, 7)


def test_plan_blend_declines_below_min_tokens_or_without_hits() -> None:
    split = split_segments([1, 2, 9, 3, 4, 9, 0], [9])
    assert plan_blend(split, 0, [True, True], min_tokens=7) is None
    assert plan_blend(split, 0, [True, True], min_tokens=6) is not None
    assert plan_blend(split, 0, [False, False], min_tokens=0) is None
    assert plan_blend(split, 6, [True, True], min_tokens=0) is None
    with pytest.raises(ValueError):
        plan_blend(split, 0, [True], min_tokens=0)

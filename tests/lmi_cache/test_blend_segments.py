"""Segments: splitting at separator token ids, and segment keys (own tokens only, never a chunk key)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmi_cache.blend.segments import Span, segment_key, separator_ids, split_segments
from lmi_cache.chunk_hashing import KeyNamespace, chunk_keys

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

"""Tests for lmi_cache.keys.chunk_format: header + payload chunk objects."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.keys.chunk_format import (
    HEADER_BYTES,
    ChunkFormatError,
    ChunkHeader,
    FingerprintMismatch,
    unpack_header,
    verify_object,
)
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, chunk_keys

KEY = chunk_keys(list(range(32)), KeyNamespace("m", "float32", "v1"), 16)[1]


def make_object(payload: bytes, key: ChunkKey = KEY, shape: tuple[int, ...] = (4,), dtype: str = "uint8") -> bytes:
    header = ChunkHeader.for_key(key, len(payload), dtype, shape).with_checksum(payload)
    return header.pack() + payload


@settings(max_examples=100, deadline=None)
@given(shape=st.lists(st.integers(0, 2**20), max_size=8), dtype=st.sampled_from(["bfloat16", "float8_e4m3fn"]),
       payload_bytes=st.integers(0, 2**40), start=st.integers(0, 2**40), length=st.integers(0, 2**20))
def test_header_round_trip(shape: list[int], dtype: str, payload_bytes: int, start: int, length: int) -> None:
    header = ChunkHeader(b"\x07" * 16, start, start + length, 2**64 - 1, payload_bytes, dtype, tuple(shape), 5, 1)
    packed = header.pack()
    assert len(packed) == HEADER_BYTES
    assert unpack_header(packed) == header


def test_verify_accepts_good_object_with_padding() -> None:
    obj = make_object(b"abcd")
    header = verify_object(obj + b"\0" * 100, KEY)
    assert header.payload_bytes == 4 and header.num_tokens == 16 and header.shape == (4,)


def test_every_single_byte_flip_is_detected() -> None:
    obj = bytearray(make_object(bytes(range(64)), shape=(64,)))
    for position in range(len(obj)):
        damaged = bytearray(obj)
        damaged[position] ^= 0x40
        with pytest.raises(ChunkFormatError):
            verify_object(bytes(damaged), KEY)


def test_truncation_detected_at_every_length() -> None:
    obj = make_object(bytes(range(64)), shape=(64,))
    for length in range(len(obj)):
        with pytest.raises(ChunkFormatError):
            verify_object(obj[:length], KEY)


def test_fingerprint_mismatch_is_its_own_error() -> None:
    foreign = ChunkKey(KEY.digest, KEY.start, KEY.end, KEY.fingerprint ^ 1)
    with pytest.raises(FingerprintMismatch):
        verify_object(make_object(b"abcd"), foreign)


def test_other_digest_and_missing_checksum_rejected() -> None:
    other = ChunkKey(b"\x00" * 16, KEY.start, KEY.end, KEY.fingerprint)
    with pytest.raises(ChunkFormatError, match="digest"):
        verify_object(make_object(b"abcd"), other)
    no_sum = ChunkHeader.for_key(KEY, 4, "uint8", (4,)).pack() + b"abcd"
    with pytest.raises(ChunkFormatError, match="checksum"):
        verify_object(no_sum, KEY)
    assert verify_object(no_sum, KEY, require_checksum=False).checksum == 0


def test_pack_rejects_unrepresentable() -> None:
    with pytest.raises(ValueError):
        ChunkHeader(b"\x00" * 16, 0, 1, 0, 0, "x", (1,) * 9).pack()
    with pytest.raises(ValueError):
        ChunkHeader(b"\x00" * 15, 0, 1, 0, 0, "x", (1,)).pack()


def test_numpy_buffers_work() -> None:
    payload = np.arange(16, dtype=np.float32)
    header = ChunkHeader.for_key(KEY, payload.nbytes, "float32", (16,)).with_checksum(payload)
    obj = np.concatenate([np.frombuffer(header.pack(), np.uint8), payload.view(np.uint8)])
    assert verify_object(obj, KEY).dtype == "float32"

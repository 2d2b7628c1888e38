"""Chunk objects: one header + the KV payload in one contiguous buffer (torch-free, worker process).

The same bytes live in the CPU tier and in a disk-tier file, so a file is just
a chunk object (plus zero padding when written with O_DIRECT). The header
names the key (digest, token range, fingerprint), the tensor (dtype name,
shape) and the payload (length, XXH3-64 checksum) and checks itself, so a
torn or foreign file is recognised without trusting anything in it.

Layout (little-endian, HEADER_BYTES = 128):
magic "LMCK" | version u16 | header bytes u16 | flags u32 | digest 16s |
start u64 | end u64 | fingerprint u64 | payload bytes u64 | checksum u64 |
dtype 16s (ASCII) | ndim u32 | shape 8 x u32 | header checksum u64
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from lmi_cache.keys.hashing import ChunkKey

MAGIC = b"LMCK"
FORMAT_VERSION = 1
HEADER_BYTES = 128
MAX_NDIM = 8
FLAG_CHECKSUM = 1  # the checksum field is filled in (always on disk; the CPU tier skips it)
_BODY = struct.Struct("<4sHHI16sQQQQQ16sI8I")
_TAIL = struct.Struct("<Q")
assert _BODY.size + _TAIL.size == HEADER_BYTES


# Anything exposing the buffer protocol over contiguous bytes.
BytesLike = bytes | bytearray | memoryview | np.ndarray


class ChunkFormatError(ValueError):
    """A buffer is not a valid chunk object (torn, truncated, corrupted or foreign)."""


class FingerprintMismatch(ChunkFormatError):
    """A valid chunk object whose token fingerprint differs from the key's (a digest collision)."""


@dataclass(frozen=True)
class ChunkHeader:
    digest: bytes
    start: int
    end: int
    fingerprint: int
    payload_bytes: int
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    checksum: int = 0
    flags: int = 0

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    @classmethod
    def for_key(cls, key: ChunkKey, payload_bytes: int, dtype: str, shape: tuple[int, ...]) -> ChunkHeader:
        return cls(key.digest, key.start, key.end, key.fingerprint, payload_bytes, dtype, tuple(shape))

    def with_checksum(self, payload: BytesLike) -> ChunkHeader:
        return ChunkHeader(
            self.digest, self.start, self.end, self.fingerprint, self.payload_bytes, self.dtype,
            self.shape, payload_checksum(payload), self.flags | FLAG_CHECKSUM,
        )

    def pack(self) -> bytes:
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"chunk tensors have at most {MAX_NDIM} dims, got {len(self.shape)}")
        dtype = self.dtype.encode("ascii")
        if len(dtype) > 16 or len(self.digest) != 16:
            raise ValueError(f"bad dtype {self.dtype!r} or digest length {len(self.digest)}")
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        body = _BODY.pack(
            MAGIC, FORMAT_VERSION, HEADER_BYTES, self.flags, self.digest, self.start, self.end,
            self.fingerprint, self.payload_bytes, self.checksum, dtype, len(self.shape), *shape,
        )
        return body + _TAIL.pack(xxhash.xxh3_64_intdigest(body))


def payload_checksum(payload: BytesLike) -> int:
    return xxhash.xxh3_64_intdigest(byte_view(payload))


def byte_view(buffer: BytesLike) -> memoryview:
    """A flat byte memoryview of any contiguous buffer (numpy arrays included)."""
    if isinstance(buffer, np.ndarray):
        return buffer.data.cast("B")
    return memoryview(buffer).cast("B")


def unpack_header(buffer: BytesLike) -> ChunkHeader:
    """Parse and self-check a header; ChunkFormatError if it is not one of ours."""
    if len(buffer) < HEADER_BYTES:
        raise ChunkFormatError(f"truncated header ({len(buffer)} bytes)")
    raw = bytes(buffer[:HEADER_BYTES])
    body, tail = raw[: _BODY.size], raw[_BODY.size :]
    if body[:4] != MAGIC:
        raise ChunkFormatError("bad magic")
    if _TAIL.unpack(tail)[0] != xxhash.xxh3_64_intdigest(body):
        raise ChunkFormatError("header checksum mismatch")
    fields = _BODY.unpack(body)
    (_, version, header_bytes, flags, digest, start, end, fingerprint, payload_bytes, checksum, dtype, ndim) = fields[
        :12
    ]
    if version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
        raise ChunkFormatError(f"unsupported format version {version}")
    if ndim > MAX_NDIM or end < start:
        raise ChunkFormatError("bad shape or token range")
    shape = tuple(fields[12 : 12 + ndim])
    name = dtype.rstrip(b"\0").decode("ascii", errors="replace")
    return ChunkHeader(digest, start, end, fingerprint, payload_bytes, name, shape, checksum, flags)


def verify_object(buffer: BytesLike, key: ChunkKey, require_checksum: bool = True) -> ChunkHeader:
    """Check a whole chunk object against ``key``; returns its header or raises.

    ``buffer`` may be longer than the object (O_DIRECT padding). Raises
    FingerprintMismatch for a foreign chunk and ChunkFormatError for damage.
    """
    view = byte_view(buffer)
    return verify_parts(view[:HEADER_BYTES], view[HEADER_BYTES:], key, require_checksum)


def verify_parts(
    header_bytes: BytesLike, payload: BytesLike, key: ChunkKey, require_checksum: bool = True
) -> ChunkHeader:
    """``verify_object`` for a header and a payload read into separate buffers."""
    header = unpack_header(header_bytes)
    payload_view = byte_view(payload)
    if len(payload_view) < header.payload_bytes:
        raise ChunkFormatError(f"truncated payload ({len(payload_view)} of {header.payload_bytes} bytes)")
    if header.digest != key.digest:
        raise ChunkFormatError("object belongs to another digest")
    if header.fingerprint != key.fingerprint or (header.start, header.end) != (key.start, key.end):
        raise FingerprintMismatch("token fingerprint differs from the key's")
    if require_checksum:
        if not header.flags & FLAG_CHECKSUM:
            raise ChunkFormatError("object has no checksum")
        if payload_checksum(payload_view[: header.payload_bytes]) != header.checksum:
            raise ChunkFormatError("payload checksum mismatch")
    return header

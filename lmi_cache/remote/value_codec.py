"""Chunk objects <-> remote store values (torch-free; vLLM worker process).

A remote value is a small value header followed by the chunk object
(``keys.chunk_format``: 128-byte chunk header + payload), with the payload
optionally compressed losslessly. With a shared secret, the value also carries
a keyed BLAKE3 MAC over the value header and body, so a client that can write
to the store but lacks the secret cannot make this server load its bytes.

Value header (little-endian, VALUE_HEADER_BYTES = 56):
magic "LMRV" | version u8 | codec u8 | flags u8 | element bytes u8 |
payload bytes u64 (uncompressed) | body bytes u64 | MAC 32s (zero without one)

Decoding never raises and never returns unverified bytes: the result is a
``DecodedChunk`` or a ``MissReason``. Order of checks: value header, MAC
(before anything else in the body is trusted), chunk header against the key,
decompression bounded by the header's payload size, payload checksum (skipped
after a valid MAC, which covers the same bytes).
"""
from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmi_cache.keys.chunk_format import (
    FLAG_CHECKSUM,
    HEADER_BYTES,
    BytesLike,
    ChunkFormatError,
    ChunkHeader,
    FingerprintMismatch,
    byte_view,
    unpack_header,
    verify_parts,
)
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.errors import ConfigError

VALUE_MAGIC = b"LMRV"
VALUE_VERSION = 1
# Bump with VALUE_VERSION: part of every store key, so old and new values never meet.
KEY_VERSION = "v1"
SECRET_ENV = "LMI_CACHE_REMOTE_SECRET"
MIN_SECRET_BYTES = 16
MAC_BYTES = 32
FLAG_MAC = 1
_VALUE = struct.Struct("<4sBBBBQQ32s")
VALUE_HEADER_BYTES = _VALUE.size
_MAC_CONTEXT = "lmi-cache 2026 remote value MAC key v1"
_ZERO_MAC = bytes(MAC_BYTES)


class Codec(enum.IntEnum):
    NONE = 0
    ZSTD = 1
    ZSTD_PLANES = 2  # bytes of each element split into planes (all low bytes, then ...), then zstd


COMPRESSION_CHOICES = {"off": Codec.NONE, "zstd": Codec.ZSTD, "zstd-planes": Codec.ZSTD_PLANES}


class MissReason(str, enum.Enum):
    """Why a remote lookup or load gave no chunk (also the ``reason`` label of counters)."""

    NOT_FOUND = "not_found"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"  # store down, backing off, or an error talking to it
    FOREIGN = "foreign"  # not one of our values (magic, version, unknown codec)
    TRUNCATED = "truncated"
    CORRUPTED = "corrupted"  # checksum, bad compressed data, inconsistent sizes
    MAC_MISSING = "mac_missing"  # a secret is configured and the value has no MAC
    MAC_INVALID = "mac_invalid"  # wrong MAC: other secret, tampered or damaged value
    FINGERPRINT = "fingerprint"  # a valid chunk of other tokens (digest collision)
    CODEC_UNAVAILABLE = "codec_unavailable"  # compressed value, compression library not installed


@dataclass(frozen=True)
class DecodedChunk:
    """A verified chunk: its header and the uncompressed payload bytes."""

    header: ChunkHeader
    payload: memoryview
    # The payload is the decoded body's own bytes after the chunk header (not decompressed into
    # new memory), so the body's memory holds the whole chunk object as the tiers lay it out.
    in_place: bool = False


def load_secret(environ: dict[str, str] | None = None) -> bytes | None:
    """The MAC secret from ``LMI_CACHE_REMOTE_SECRET`` (None when unset or empty)."""
    env = os.environ if environ is None else environ
    value = env.get(SECRET_ENV, "")
    if not value:
        return None
    secret = value.encode("utf-8")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{SECRET_ENV} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} random bytes "
            "(e.g. the output of `openssl rand -hex 32`), the same on every server of the fleet"
        )
    return secret


class ValueCodec:
    """Encodes chunk objects for a remote store and verifies what comes back."""

    def __init__(self, secret: bytes | None = None, compression: str = "off", zstd_level: int = 1) -> None:
        if compression not in COMPRESSION_CHOICES:
            raise ConfigError(
                f"remote compression {compression!r} is not supported; use one of {', '.join(COMPRESSION_CHOICES)}"
            )
        self.codec = COMPRESSION_CHOICES[compression]
        self.zstd_level = zstd_level
        self._mac_key: bytes | None = None
        if secret is not None:
            try:
                import blake3
            except ImportError:
                raise ConfigError(
                    f"{SECRET_ENV} is set but the blake3 package is missing; pip install 'lmi-cache[remote]'"
                ) from None
            self._mac_key = blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()
        self._zstd: Any = _import_zstd() if self.codec != Codec.NONE else None

    @property
    def has_mac(self) -> bool:
        return self._mac_key is not None

    # ------------------------------------------------------------ encode
    def encode(self, obj: BytesLike, key: ChunkKey | None = None) -> bytes:
        """A chunk object (header + payload) -> value bytes; fills in a missing payload checksum.

        With ``key``, refuses (ChunkFormatError) an object whose header names another chunk.
        """
        view = byte_view(obj)
        header = unpack_header(view)
        if key is not None and (header.digest, header.fingerprint, header.start, header.end) != (
            key.digest, key.fingerprint, key.start, key.end
        ):
            raise ChunkFormatError("chunk object does not belong to the key it is stored under")
        payload = view[HEADER_BYTES : HEADER_BYTES + header.payload_bytes]
        if len(payload) != header.payload_bytes:
            raise ChunkFormatError(f"truncated payload ({len(payload)} of {header.payload_bytes} bytes)")
        if not header.flags & FLAG_CHECKSUM:
            header = header.with_checksum(payload)
        codec, elem_bytes, body_payload = self._compress(header, payload)
        chunk_header = header.pack()
        body_bytes = HEADER_BYTES + len(body_payload)
        flags = FLAG_MAC if self._mac_key is not None else 0
        fields = (VALUE_MAGIC, VALUE_VERSION, int(codec), flags, elem_bytes, header.payload_bytes, body_bytes)
        mac = self._mac(_VALUE.pack(*fields, _ZERO_MAC), chunk_header, body_payload) if flags else _ZERO_MAC
        return b"".join((_VALUE.pack(*fields, mac), chunk_header, body_payload))

    def _compress(self, header: ChunkHeader, payload: memoryview) -> tuple[Codec, int, bytes | memoryview]:
        if self.codec == Codec.NONE or not len(payload):
            return Codec.NONE, 0, payload
        codec, elem_bytes, source = self.codec, 0, payload
        if codec == Codec.ZSTD_PLANES:
            elem_bytes = _element_bytes(header.dtype)
            if elem_bytes > 1 and len(payload) % elem_bytes == 0:
                source = byte_view(split_planes(payload, elem_bytes))
            else:
                codec, elem_bytes = Codec.ZSTD, 0
        packed: bytes = self._zstd.ZstdCompressor(level=self.zstd_level).compress(source)
        if len(packed) >= len(payload):  # incompressible: store it plain, decoding is free
            return Codec.NONE, 0, payload
        return codec, elem_bytes, packed

    def _mac(self, value_header: bytes, chunk_header: bytes | memoryview, body_payload: bytes | memoryview) -> bytes:
        import blake3

        assert self._mac_key is not None
        hasher = blake3.blake3(key=self._mac_key)
        hasher.update(value_header)
        hasher.update(chunk_header)
        hasher.update(body_payload)
        digest: bytes = hasher.digest()
        return digest

    # ------------------------------------------------------------ decode
    def decode(self, value: BytesLike | None, key: ChunkKey) -> DecodedChunk | MissReason:
        """Verify ``value`` against ``key``; a DecodedChunk, or why it is a miss. Never raises."""
        if value is None:
            return MissReason.NOT_FOUND
        view = byte_view(value)
        return self.decode_parts(view[:VALUE_HEADER_BYTES], view[VALUE_HEADER_BYTES:], key)

    def decode_parts(self, head: BytesLike, body: BytesLike, key: ChunkKey) -> DecodedChunk | MissReason:
        """``decode`` of a value received in two parts: its first VALUE_HEADER_BYTES, and the rest."""
        try:
            return self._decode_parts(byte_view(head), byte_view(body), key)
        except Exception:  # the last line of defence: a decode fault is a miss, never an error
            return MissReason.CORRUPTED

    def _decode_parts(self, head: memoryview, body: memoryview, key: ChunkKey) -> DecodedChunk | MissReason:
        if len(head) < VALUE_HEADER_BYTES:
            return MissReason.FOREIGN if bytes(head[:4]) != VALUE_MAGIC[: len(head[:4])] else MissReason.TRUNCATED
        magic, version, codec_id, flags, elem_bytes, payload_bytes, body_bytes, mac = _VALUE.unpack_from(head)
        if magic != VALUE_MAGIC or version != VALUE_VERSION or codec_id not in Codec._value2member_map_:
            return MissReason.FOREIGN
        if flags & ~FLAG_MAC:
            return MissReason.FOREIGN
        if (codec_id == Codec.ZSTD_PLANES) != (elem_bytes > 1) or (not flags & FLAG_MAC and mac != _ZERO_MAC):
            return MissReason.CORRUPTED
        if len(body) < body_bytes:
            return MissReason.TRUNCATED
        if len(body) > body_bytes or body_bytes < HEADER_BYTES:
            return MissReason.CORRUPTED
        if self._mac_key is not None:
            if not flags & FLAG_MAC:
                return MissReason.MAC_MISSING
            unsigned = _VALUE.pack(magic, version, codec_id, flags, elem_bytes, payload_bytes, body_bytes, _ZERO_MAC)
            if not _equal(self._mac(unsigned, body[:HEADER_BYTES], body[HEADER_BYTES:]), mac):
                return MissReason.MAC_INVALID
        try:
            header = unpack_header(body)
        except ChunkFormatError:
            return MissReason.CORRUPTED
        if header.digest != key.digest:
            return MissReason.CORRUPTED  # a value stored under another digest's key
        if header.fingerprint != key.fingerprint or (header.start, header.end) != (key.start, key.end):
            return MissReason.FINGERPRINT
        if header.payload_bytes != payload_bytes:
            return MissReason.CORRUPTED
        payload = self._decompress(Codec(codec_id), elem_bytes, body[HEADER_BYTES:], payload_bytes)
        if isinstance(payload, MissReason):
            return payload
        # A verified MAC already proves these are the bytes a secret holder encoded (checksum included).
        mac_verified = self._mac_key is not None
        try:
            verify_parts(body[:HEADER_BYTES], payload, key, require_checksum=not mac_verified)
        except FingerprintMismatch:
            return MissReason.FINGERPRINT
        except ChunkFormatError:
            return MissReason.CORRUPTED
        return DecodedChunk(header, payload, in_place=codec_id == Codec.NONE)

    def _decompress(self, codec: Codec, elem_bytes: int, data: memoryview, size: int) -> memoryview | MissReason:
        if codec == Codec.NONE:
            return data if len(data) == size else MissReason.CORRUPTED
        zstd = self._zstd
        if zstd is None:
            try:
                zstd = self._zstd = _import_zstd()
            except ConfigError:
                return MissReason.CODEC_UNAVAILABLE
        try:
            raw = zstd.ZstdDecompressor().decompress(data, max_output_size=size)
        except zstd.ZstdError:
            return MissReason.CORRUPTED
        if len(raw) != size:
            return MissReason.CORRUPTED
        if codec == Codec.ZSTD_PLANES:
            if elem_bytes < 2 or size % elem_bytes:
                return MissReason.CORRUPTED
            return join_planes(raw, elem_bytes)
        return memoryview(raw)


def split_planes(payload: BytesLike, elem_bytes: int) -> bytes:
    """[b0 b1 | b0 b1 | ...] -> [all b0 | all b1]: exponent bytes of KV values sit together and compress."""
    array = np.frombuffer(byte_view(payload), dtype=np.uint8).reshape(-1, elem_bytes)
    return np.ascontiguousarray(array.T).tobytes()


def join_planes(planes: BytesLike, elem_bytes: int) -> memoryview:
    if not len(byte_view(planes)):
        return memoryview(b"")
    array = np.frombuffer(byte_view(planes), dtype=np.uint8).reshape(elem_bytes, -1)
    out = np.empty((array.shape[1], elem_bytes), dtype=np.uint8)
    for plane in range(elem_bytes):  # column writes: several times faster than a transposed copy
        out[:, plane] = array[plane]
    return byte_view(out)


def _element_bytes(dtype: str) -> int:
    sizes = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int16": 2, "int32": 4}
    return sizes.get(dtype, 1)


def _equal(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)


def _import_zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ConfigError(
            "remote compression needs the zstandard package; pip install 'lmi-cache[remote]' "
            "or set the remote compression to off"
        ) from None
    return zstandard


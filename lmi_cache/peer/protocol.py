"""What peers say to each other over ZMQ (msgpack maps), and the identity they must share (worker process).

Four requests, each answered by one reply on the same socket:

- ``hello`` (the peer's ``p2p_init_ports`` port of the asker's rank): the
  asker's identity; the answer is the peer's transfer-engine session id and
  lookup port, or a refusal naming the field that differs.
- ``has`` (the lookup port): digests; the answer says which the peer's CPU
  tier holds now (the scheduler's question: nothing is pinned).
- ``lookup`` (the lookup port): digests; the answer says, per digest, where
  the chunk object lies in the peer's registered memory (address, object
  bytes, payload checksum) or nothing, under one lease the peer keeps for
  ``lease_ms`` (the buffers stay referenced and registered until then).
- ``release``: the lease is done with (the reader has its bytes).

The identity is what a key already encodes (the key namespace: model, its
identity, KV dtype, layout tag, chunk size, TP and PP size) plus the key
scheme's version; chunk keys differ whenever any of it differs, so a
mismatch could never hit, and the handshake refuses it up front instead of
leasing nothing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    from lmi_cache.keys.hashing import KeySpace

# Bumped when the key scheme or the chunk format changes what a digest means.
KEY_SCHEME = "lmi-cache-keys-1"
PROTOCOL = 1


@dataclass(frozen=True)
class PeerIdentity:
    """What two peers must agree on before one reads the other's chunks."""

    model: str
    model_identity: str
    kv_dtype: str
    layout: str
    chunk_size: int
    tp_size: int
    pp_size: int
    key_scheme: str = KEY_SCHEME

    @classmethod
    def of(cls, space: KeySpace) -> PeerIdentity:
        return cls(space.model, space.model_identity, space.kv_dtype, space.layout, space.chunk_size, space.tp_size,
                   space.pp_size)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self, other: Any) -> list[str]:
        """The fields of ``other`` (a wire map) that differ from ours, as ``name: ours != theirs``."""
        if not isinstance(other, dict):
            return ["identity: missing"]
        ours = self.to_wire()
        return [f"{name}: {value!r} != {other.get(name)!r}" for name, value in ours.items()
                if other.get(name) != value]


@dataclass(frozen=True)
class ChunkLocation:
    """Where a leased chunk object lies in a peer's registered memory."""

    address: int
    object_bytes: int  # header + payload
    checksum: int  # XXH3-64 of the payload, computed by the peer when it leased the chunk


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(raw: bytes) -> dict[str, Any]:
    """A message map; ValueError for anything else (a foreign or damaged message)."""
    try:
        message = msgpack.unpackb(raw, raw=False)
    except Exception as err:  # msgpack raises several types for damaged input
        raise ValueError(f"not a peer message ({err})") from None
    if not isinstance(message, dict):
        raise ValueError("not a peer message (not a map)")
    return message


def locations_from_wire(entries: Any, count: int) -> list[ChunkLocation | None]:
    """A lookup reply's locations, one per asked digest; ValueError when it does not fit the question."""
    if not isinstance(entries, list) or len(entries) != count:
        raise ValueError("lookup reply does not answer every digest")
    out: list[ChunkLocation | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
        elif isinstance(entry, list) and len(entry) == 3 and all(isinstance(v, int) for v in entry):
            out.append(ChunkLocation(entry[0], entry[1], entry[2]))
        else:
            raise ValueError("malformed chunk location")
    return out

"""PeerTier: chunks read from a peer's CPU tier, as one more tier of the engine (worker process).

It holds nothing: ``get_many_from`` reads the keys the placement directory
planned from a peer (their source names it, ``peer@H:P``) through the
``PeerClient`` (lease, one transfer-engine read, verification), into host
buffers of the engine's allocator, and hands them out as chunk objects; the
engine then puts each into the CPU tier where the directory reserved its
place (a promotion by reference, no copy), and the connector scatters it
like any CPU-tier hit. Without a source (an undirected load) it has nothing
to offer. Every fault is a miss counted by the client.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.peer.client import PeerClient
from lmi_cache.peer.hint import PEER, PeerAddress, source_peer
from lmi_cache.tiers.base import HitBatch, RemoteHeldTier
from lmi_cache.tiers.host_memory import ChunkObject, HostAllocator


class PeerTier(RemoteHeldTier):
    """See the module docstring. The scheduler asks the peer itself whether it holds a chunk."""

    name = PEER

    def __init__(self, client: PeerClient, allocator: HostAllocator) -> None:
        self.client = client
        self._allocator = allocator

    def get_many(self, keys: Sequence[ChunkKey]) -> Iterator[HitBatch]:
        return iter(())  # no peer named: nothing to read

    def get_many_from(self, keys: Sequence[ChunkKey], sources: Sequence[str]) -> Iterator[HitBatch]:
        by_peer: dict[PeerAddress, list[int]] = {}
        for position, source in enumerate(sources):
            peer = source_peer(source)
            if peer is not None:
                by_peer.setdefault(peer, []).append(position)
        for peer, positions in by_peer.items():
            batch: HitBatch = []
            received = self.client.read_many(peer, [keys[i] for i in positions])
            for position, entry in zip(positions, received):
                if entry is not None:
                    header, buffer = entry
                    batch.append((position, ChunkObject(keys[position], header, buffer, self._allocator)))
            if batch:
                yield batch

    def put(self, obj: ChunkObject) -> bool:
        return False  # peers read our CPU tier; nothing is written to them

    def close(self) -> None:
        self.client.close()

"""PeerClient: asks a peer for chunks and reads them through the transfer engine (worker process).

One read of a batch of keys from one peer: ``hello`` once per peer (cached;
a refusal is remembered, so a mismatched peer costs one round trip), then
``lookup`` under a lease, one batched transfer-engine read of every leased
chunk into host buffers the caller allocates, ``release``, and the same checks
as a remote-store hit: the header parses and checks itself, names the key's
digest, token range and fingerprint, and the payload's checksum is the one
the peer computed when it leased the chunk. Anything else is a miss.

The whole read is bounded by ``timeout_ms``: control messages use ZMQ
timeouts (a socket that timed out is dropped, never reused), and the engine
read runs on a small pool the caller waits on; when it is late, its
destination buffers are handed to the read and recycled when it returns, so
a dead peer costs at most the bound and never a reused buffer. Faults are
counted by reason (``lmi_cache_peer_faults_total``): ``unreachable``,
``timeout``, ``refused`` (identity or protocol mismatch), ``bad_reply``,
``transfer`` (the engine failed the read), ``corrupted`` (bytes do not
match the key or checksum), ``no_memory``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
from lmi_cache.keys.chunk_format import HEADER_BYTES, ChunkFormatError, ChunkHeader, payload_checksum, verify_object
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.peer.control import PeerControl, PeerFault, PeerLink
from lmi_cache.peer.hint import PeerAddress
from lmi_cache.peer.protocol import ChunkLocation, PeerIdentity, locations_from_wire
from lmi_cache.peer.transport import PeerTransport
from lmi_cache.thread_affinity import unpin_current_thread

logger = logging.getLogger(__name__)

# Host memory for one received object (at least ``num_bytes``), or None when short; and its return.
Allocate = Callable[[int], torch.Tensor | None]
Recycle = Callable[[torch.Tensor], None]
# Counts one fault of the peer tier by reason.
CountFault = Callable[[str], None]


class PeerClient:
    """See the module docstring. ``rank``: this worker's rank, which reads the same rank of the peer."""

    def __init__(self, identity: PeerIdentity, transport: PeerTransport, *, rank: int, timeout_ms: int,
                 lease_ms: int, allocate: Allocate, recycle: Recycle, count_fault: CountFault) -> None:
        self.identity = identity
        self._transport = transport
        self._rank = rank
        self.timeout_ms = timeout_ms
        self._lease_ms = lease_ms
        self._allocate = allocate
        self._recycle = recycle
        self._count_fault = count_fault
        self._control = PeerControl(identity)
        self._lock = threading.Lock()  # one read at a time: the engine's sockets are cached per peer
        self._reads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmi-peer-read",
                                         initializer=unpin_current_thread)

    def read_many(self, peer: PeerAddress, keys: Sequence[ChunkKey]) -> list[tuple[ChunkHeader, torch.Tensor] | None]:
        """Per key, its verified header and the buffer holding the object (the caller owns it), or None."""
        results: list[tuple[ChunkHeader, torch.Tensor] | None] = [None] * len(keys)
        if not keys:
            return results
        deadline = time.monotonic() + self.timeout_ms / 1000
        with self._lock:
            try:
                link = self._control.link(peer, self._rank, deadline)
                reply = self._control.ask(link.lookup, {"op": "lookup", "digests": [k.digest for k in keys],
                                                "lease_ms": self._lease_ms}, deadline)
                lease = reply.get("lease")
                try:
                    locations = locations_from_wire(reply.get("chunks"), len(keys))
                    self._read(link, keys, locations, deadline, results)
                finally:
                    self._release(link, lease)
            except PeerFault as fault:
                if fault.reason in ("unreachable", "timeout"):
                    self._control.forget(peer)  # it may come back elsewhere (a restart picks a new engine port)
                self._count_fault(fault.reason)
                logger.debug("lmi-cache: peer %s:%d: %s", peer.host, peer.init_port, fault)
            except ValueError as err:
                self._count_fault("bad_reply")
                logger.debug("lmi-cache: peer %s:%d: %s", peer.host, peer.init_port, err)
        return results

    def _release(self, link: PeerLink, lease: Any) -> None:
        if not isinstance(lease, int):
            return
        try:
            self._control.ask(link.lookup, {"op": "release", "lease": lease}, time.monotonic() + self.timeout_ms / 1000)
        except PeerFault:
            pass  # the lease ends on its own after lease_ms

    def _read(self, link: PeerLink, keys: Sequence[ChunkKey], locations: list[ChunkLocation | None], deadline: float,
              results: list[tuple[ChunkHeader, torch.Tensor] | None]) -> None:
        wanted: list[tuple[int, ChunkLocation, torch.Tensor]] = []
        for position, location in enumerate(locations):
            if location is None:
                continue
            buffer = self._allocate(location.object_bytes)
            if buffer is None:
                self._count_fault("no_memory")
                continue
            wanted.append((position, location, buffer))
        if not wanted:
            return
        future = self._reads.submit(self._transfer, link.session, wanted)
        try:
            landed = future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            future.add_done_callback(lambda _: self._give_back(wanted))  # the read still writes into them
            raise PeerFault("timeout", "transfer not done in time") from None
        if not landed:
            self._give_back(wanted)
            raise PeerFault("transfer", "the transfer engine failed the read")
        for position, location, buffer in wanted:
            header = self._verify(keys[position], location, buffer)
            if header is None:
                self._recycle(buffer)
            else:
                results[position] = (header, buffer)

    def _transfer(self, session: str, wanted: list[tuple[int, ChunkLocation, torch.Tensor]]) -> bool:
        local = [buffer.data_ptr() for _, _, buffer in wanted]
        lengths = [location.object_bytes for _, location, _ in wanted]
        registered = [a for a, n in zip(local, lengths) if self._transport.register(a, n)]
        try:
            return self._transport.read(session, local, [loc.address for _, loc, _ in wanted], lengths)
        finally:
            for address in registered:
                self._transport.unregister(address)

    def _give_back(self, wanted: list[tuple[int, ChunkLocation, torch.Tensor]]) -> None:
        for _, _, buffer in wanted:
            self._recycle(buffer)

    def _verify(self, key: ChunkKey, location: ChunkLocation, buffer: torch.Tensor) -> ChunkHeader | None:
        array = buffer[: location.object_bytes].numpy()
        try:
            # The CPU tier's objects carry no checksum of their own: the lease's checksum stands in for it.
            header = verify_object(array, key, require_checksum=False)
            if header.total_bytes != location.object_bytes:
                raise ChunkFormatError("object length differs from the lease's")
            if payload_checksum(array[HEADER_BYTES:]) != location.checksum:
                raise ChunkFormatError("payload checksum mismatch")
        except ChunkFormatError as err:
            self._count_fault("corrupted")
            logger.debug("lmi-cache: peer chunk refused (%s)", err)
            return None
        return header

    def close(self) -> None:
        self._reads.shutdown(wait=False, cancel_futures=True)

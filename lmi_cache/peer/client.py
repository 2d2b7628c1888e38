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
import zmq

from lmi_cache.keys.chunk_format import HEADER_BYTES, ChunkFormatError, ChunkHeader, payload_checksum, unpack_header
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.peer.protocol import PROTOCOL, ChunkLocation, PeerIdentity, locations_from_wire, pack, unpack
from lmi_cache.peer.transport import PeerTransport
from lmi_cache.thread_affinity import unpin_current_thread

logger = logging.getLogger(__name__)

# Host memory for one received object (at least ``num_bytes``), or None when short; and its return.
Allocate = Callable[[int], torch.Tensor | None]
Recycle = Callable[[torch.Tensor], None]
# Counts one fault of the peer tier by reason.
CountFault = Callable[[str], None]


@dataclass(frozen=True)
class PeerAddress:
    host: str
    init_port: int  # the peer's p2p_init_ports port of rank 0 (what a router's hint names)


@dataclass(frozen=True)
class _Link:
    session: str  # the peer engine's session id
    lookup: str  # its lookup endpoint


class PeerFault(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


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
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._links: dict[PeerAddress, _Link] = {}
        self._refused: dict[PeerAddress, str] = {}
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
                link = self._link(peer, deadline)
                reply = self._ask(link.lookup, {"op": "lookup", "digests": [k.digest for k in keys],
                                                "lease_ms": self._lease_ms}, deadline)
                lease = reply.get("lease")
                try:
                    locations = locations_from_wire(reply.get("chunks"), len(keys))
                    self._read(link, keys, locations, deadline, results)
                finally:
                    self._release(link, lease)
            except PeerFault as fault:
                self._count_fault(fault.reason)
                logger.debug("lmi-cache: peer %s:%d: %s", peer.host, peer.init_port, fault)
            except ValueError as err:
                self._count_fault("bad_reply")
                logger.debug("lmi-cache: peer %s:%d: %s", peer.host, peer.init_port, err)
        return results

    def _link(self, peer: PeerAddress, deadline: float) -> _Link:
        link = self._links.get(peer)
        if link is not None:
            return link
        if peer in self._refused:
            raise PeerFault("refused", self._refused[peer])
        endpoint = f"tcp://{peer.host}:{peer.init_port}"
        reply = self._ask(endpoint, {"op": "hello"}, deadline)
        ports = reply.get("init_ports")
        if self._rank and isinstance(ports, list) and len(ports) > self._rank:  # rank r reads rank r of the peer
            reply = self._ask(f"tcp://{peer.host}:{int(ports[self._rank])}", {"op": "hello"}, deadline)
        session, lookup_port = reply.get("session"), reply.get("lookup_port")
        if not isinstance(session, str) or not isinstance(lookup_port, int):
            raise PeerFault("bad_reply", "hello answer without session or lookup port")
        link = _Link(session, f"tcp://{peer.host}:{lookup_port}")
        self._links[peer] = link
        return link

    def _ask(self, endpoint: str, message: dict[str, Any], deadline: float) -> dict[str, Any]:
        """One request and its reply within the deadline; a fresh socket each time (REQ cannot recover)."""
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0:
            raise PeerFault("timeout", "no time left")
        socket: zmq.Socket[bytes] = self._context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, remaining_ms)
        socket.setsockopt(zmq.SNDTIMEO, remaining_ms)
        try:
            socket.connect(endpoint)
            socket.send(pack({**message, "identity": self.identity.to_wire(), "protocol": PROTOCOL}))
            reply = unpack(socket.recv())
        except zmq.Again:
            raise PeerFault("timeout", f"no answer from {endpoint}") from None
        except zmq.ZMQError as err:
            raise PeerFault("unreachable", f"{endpoint}: {err}") from None
        finally:
            socket.close(linger=0)
        if not reply.get("ok"):
            reason = str(reply.get("reason", "bad_reply"))
            if reason == "refused":
                self._refuse(endpoint, str(reply.get("detail", "")))
            raise PeerFault(reason if reason in ("refused", "bad_request") else "bad_reply",
                            str(reply.get("detail", "")))
        return reply

    def _refuse(self, endpoint: str, detail: str) -> None:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self._refused[PeerAddress(host, int(port))] = detail
        logger.warning("lmi-cache: peer %s refused (%s); not asked again", endpoint, detail)

    def _release(self, link: _Link, lease: Any) -> None:
        if not isinstance(lease, int):
            return
        try:
            self._ask(link.lookup, {"op": "release", "lease": lease}, time.monotonic() + self.timeout_ms / 1000)
        except PeerFault:
            pass  # the lease ends on its own after lease_ms

    def _read(self, link: _Link, keys: Sequence[ChunkKey], locations: list[ChunkLocation | None], deadline: float,
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
            header = unpack_header(array)
            if (header.digest, header.start, header.end, header.fingerprint) != (
                    key.digest, key.start, key.end, key.fingerprint):
                raise ChunkFormatError("object belongs to another key")
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

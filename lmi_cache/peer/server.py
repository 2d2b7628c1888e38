"""PeerServer: answers one rank's peers, leasing chunks of its CPU tier to their reads (worker process).

Each worker rank runs one: a thread serving two ZMQ reply sockets, the
rank's ``p2p_init_ports`` port (``hello``: identity check, then the engine's
session id and the lookup port) and its ``p2p_lookup_ports`` port
(``has``, ``lookup`` and ``release``, ``protocol`` says what they carry). A lookup
takes a reference to every chunk object the CPU tier holds among the
digests and registers its buffer with the transfer engine, so eviction
meanwhile only drops the tier's reference and the bytes stay put; the lease
ends on ``release`` or after ``lease_ms``, whichever comes first, and then
the references go and the buffers are unregistered. The peer's read itself
never involves this thread: the transfer engine serves registered memory.

The payload checksum in a lookup answer is computed here (the CPU tier keeps
none): a reader checks the bytes it received against it and against its own
key, so a buffer reused under a race, a damaged transfer or a hostile peer
is a miss on the reader's side.

``LMI_CACHE_TEST_PEER_CORRUPT=<file>`` (tests only): while that file exists,
the server leases a copy of each chunk with one payload byte flipped, so
end-to-end tests can prove a reader never loads bad bytes from a live
server; the server warns at start when the variable is set.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from lmi_cache.keys.chunk_format import payload_checksum
from lmi_cache.peer.protocol import PROTOCOL, PeerIdentity, pack, unpack
from lmi_cache.peer.threads import peer_context
from lmi_cache.peer.transport import PeerTransport
from lmi_cache.thread_affinity import unpin_current_thread
from lmi_cache.tiers.host_memory import ChunkObject

logger = logging.getLogger(__name__)

CORRUPT_ENV = "LMI_CACHE_TEST_PEER_CORRUPT"
POLL_MS = 50  # how often the serving thread looks at expired leases and at close()
MAX_LEASE_MS = 60_000  # a peer cannot pin our memory longer than this, whatever it asks

# The CPU tier's view for peers: a reference to the object of a digest (the caller releases it), or None.
Holder = Callable[[bytes], ChunkObject | None]


@dataclass
class _Lease:
    expires_at: float
    objects: list[ChunkObject] = field(default_factory=list)
    copies: list[torch.Tensor] = field(default_factory=list)  # corrupted copies (test hook) kept alive
    addresses: list[int] = field(default_factory=list)


class PeerServer:
    """See the module docstring. ``init_port`` / ``lookup_port`` 0: any free port (tests)."""

    def __init__(self, identity: PeerIdentity, transport: PeerTransport, holder: Holder, *, host: str,
                 init_port: int, lookup_port: int, init_ports: list[int] | None = None,
                 corrupt_for_test: bool | None = None) -> None:
        self.identity = identity
        self._transport = transport
        self._holder = holder
        self._corrupt_flag = os.environ.get(CORRUPT_ENV, "")
        self._corrupt_always = corrupt_for_test
        if self._corrupt_flag:
            logger.warning("lmi-cache: %s is set: the peer server serves corrupted chunks while %s exists (a test "
                           "hook)", CORRUPT_ENV, self._corrupt_flag)
        self._context = peer_context()
        self._init = self._bind(host, init_port)
        self._lookup = self._bind(host, lookup_port)
        self.init_port = _bound_port(self._init)
        self.lookup_port = _bound_port(self._lookup)
        self._init_ports = list(init_ports) if init_ports else [self.init_port]  # every rank's, for hello answers
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmi-peer-server", daemon=True)
        self._thread.start()

    def _bind(self, host: str, port: int) -> zmq.Socket[bytes]:
        socket: zmq.Socket[bytes] = self._context.socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        if port:
            socket.bind(f"tcp://{host}:{port}")
        else:
            socket.bind_to_random_port(f"tcp://{host}")
        return socket

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    # ------------------------------------------------------------ serving thread
    def _serve(self) -> None:
        # Off the OpenMP master's core the worker's main thread is bound to (``threads`` says why).
        unpin_current_thread()
        poller = zmq.Poller()
        poller.register(self._init, zmq.POLLIN)
        poller.register(self._lookup, zmq.POLLIN)
        try:
            while not self._closed.is_set():
                ready = dict(poller.poll(POLL_MS))
                for socket in (self._init, self._lookup):
                    if socket in ready:
                        socket.send(pack(self._answer(socket.recv())))
                try:
                    self._expire(time.monotonic())
                except Exception:  # noqa: BLE001 - the server must outlive a fault in one lease's clean-up
                    logger.exception("lmi-cache: peer server: a lease's clean-up failed")
        except zmq.ZMQError as err:
            if not self._closed.is_set():
                logger.warning("lmi-cache: peer server stopped (%s); peers now miss here", err)
        except Exception:  # noqa: BLE001 - say so: peers then miss here until the server restarts
            logger.exception("lmi-cache: peer server stopped; peers now miss here")
        finally:
            self._expire(float("inf"))
            for socket in (self._init, self._lookup):
                socket.close(linger=0)

    def _answer(self, raw: bytes) -> dict[str, Any]:
        try:
            message = unpack(raw)
            problems = self.identity.differences(message.get("identity"))
            if message.get("protocol") != PROTOCOL:
                problems.append(f"protocol: {PROTOCOL} != {message.get('protocol')!r}")
            if problems:
                return {"ok": False, "reason": "refused", "detail": "; ".join(problems)}
            op = message.get("op")
            if op == "hello":
                return {"ok": True, "session": self._transport.session_id, "lookup_port": self.lookup_port,
                        "init_ports": self._init_ports}
            if op == "has":
                return self._has(message.get("digests"))
            if op == "lookup":
                return self._lease(message.get("digests"), message.get("lease_ms"))
            if op == "release":
                lease = self._leases.pop(int(message.get("lease", 0)), None)
                if lease is not None:
                    self._end(lease)
                return {"ok": True}
            return {"ok": False, "reason": "bad_request", "detail": f"unknown op {op!r}"}
        except Exception as err:  # noqa: BLE001 - a bad request never stops the server
            return {"ok": False, "reason": "bad_request", "detail": str(err)}

    def _has(self, digests: Any) -> dict[str, Any]:
        if not _digest_list(digests):
            return {"ok": False, "reason": "bad_request", "detail": "digests must be a list of bytes"}
        held = []
        for digest in digests:
            obj = self._holder(digest)
            held.append(obj is not None)
            if obj is not None:
                obj.release()
        return {"ok": True, "held": held}

    def _lease(self, digests: Any, lease_ms: Any) -> dict[str, Any]:
        if not _digest_list(digests):
            return {"ok": False, "reason": "bad_request", "detail": "digests must be a list of bytes"}
        duration_ms = min(max(int(lease_ms or 0), 1), MAX_LEASE_MS)
        lease = _Lease(time.monotonic() + duration_ms / 1000)
        chunks: list[list[int] | None] = []
        for digest in digests:
            obj = self._holder(digest)
            if obj is not None and obj.header.digest != digest:
                obj.release()
                obj = None
            if obj is None:
                chunks.append(None)
                continue
            lease.objects.append(obj)
            chunks.append(self._offer(obj, lease))
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = lease
        return {"ok": True, "lease": lease_id, "chunks": chunks}

    def _offer(self, obj: ChunkObject, lease: _Lease) -> list[int] | None:
        """Register the object's bytes for the lease; its location, or None when the engine refuses."""
        buffer = obj.buffer[: obj.header.total_bytes]
        checksum = payload_checksum(obj.payload_array())
        if self._corrupting():
            buffer = buffer.clone()
            buffer[-1] ^= 0xFF
            lease.copies.append(buffer)
        address, length = buffer.data_ptr(), obj.header.total_bytes
        if not self._transport.register(address, length):
            return None
        lease.addresses.append(address)
        return [address, length, checksum]

    def _corrupting(self) -> bool:
        if self._corrupt_always is not None:
            return self._corrupt_always
        return bool(self._corrupt_flag) and os.path.exists(self._corrupt_flag)

    def _expire(self, now: float) -> None:
        for lease_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            self._end(self._leases.pop(lease_id))

    def _end(self, lease: _Lease) -> None:
        for address in lease.addresses:
            self._transport.unregister(address)
        for obj in lease.objects:
            obj.release()
        lease.objects.clear()
        lease.copies.clear()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5.0)


def _digest_list(digests: Any) -> bool:
    return isinstance(digests, list) and all(isinstance(d, bytes) for d in digests)


def _bound_port(socket: zmq.Socket[bytes]) -> int:
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    text = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
    return int(text.rsplit(":", 1)[1])

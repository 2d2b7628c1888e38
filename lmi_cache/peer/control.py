"""PeerControl: the asking side of the peer protocol's control messages (scheduler and worker processes).

One request and its reply per call, within a deadline, on a fresh ZMQ REQ
socket (a REQ socket that timed out cannot be reused). ``link`` does the
handshake once per peer and rank and caches where that rank's lookups go
and its transfer engine's session id; a peer that refused our identity is
remembered and not asked again, so a misconfigured peer costs one round trip.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from lmi_cache.peer.hint import PeerAddress
from lmi_cache.peer.protocol import PROTOCOL, PeerIdentity, pack, unpack
from lmi_cache.peer.threads import peer_context

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerLink:
    session: str  # the peer rank's transfer-engine session id
    lookup: str  # its lookup endpoint


class PeerFault(Exception):
    """A peer could not answer; ``reason`` is the metric label (unreachable, timeout, refused, bad_reply)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class PeerControl:
    """See the module docstring. Thread-safe."""

    def __init__(self, identity: PeerIdentity) -> None:
        self.identity = identity
        self._context = peer_context()
        self._lock = threading.Lock()
        self._links: dict[tuple[PeerAddress, int], PeerLink] = {}
        self._refused: dict[PeerAddress, str] = {}

    def link(self, peer: PeerAddress, rank: int, deadline: float) -> PeerLink:
        """Rank ``rank`` of ``peer``: handshake once (rank 0's answer names every rank's init port)."""
        with self._lock:
            link = self._links.get((peer, rank))
            refused = self._refused.get(peer)
        if link is not None:
            return link
        if refused is not None:
            raise PeerFault("refused", refused)
        try:
            reply = self.ask(f"tcp://{peer.host}:{peer.init_port}", {"op": "hello"}, deadline)
            ports = reply.get("init_ports")
            if rank:
                if not isinstance(ports, list) or len(ports) <= rank or not isinstance(ports[rank], int):
                    raise PeerFault("refused", f"the peer has no rank {rank}")
                reply = self.ask(f"tcp://{peer.host}:{ports[rank]}", {"op": "hello"}, deadline)
        except PeerFault as fault:
            if fault.reason == "refused":
                with self._lock:
                    self._refused[peer] = str(fault)
                logger.warning("lmi-cache: peer %s refused (%s); not asked again", peer.text, fault)
            raise
        session, lookup_port = reply.get("session"), reply.get("lookup_port")
        if not isinstance(session, str) or not isinstance(lookup_port, int):
            raise PeerFault("bad_reply", "hello answer without session or lookup port")
        link = PeerLink(session, f"tcp://{peer.host}:{lookup_port}")
        with self._lock:
            self._links[(peer, rank)] = link
        return link

    def forget(self, peer: PeerAddress) -> None:
        """Drop cached links to ``peer`` (it went away: the next ask does the handshake again)."""
        with self._lock:
            for key in [k for k in self._links if k[0] == peer]:
                del self._links[key]

    def ask(self, endpoint: str, message: dict[str, Any], deadline: float) -> dict[str, Any]:
        """One request and its reply before ``deadline`` (time.monotonic); PeerFault otherwise."""
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
        except ValueError as err:
            raise PeerFault("bad_reply", str(err)) from None
        finally:
            socket.close(linger=0)
        if not reply.get("ok"):
            reason = reply.get("reason")
            raise PeerFault("refused" if reason == "refused" else "bad_reply", str(reply.get("detail", "")))
        return reply

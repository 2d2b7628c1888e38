"""A worker rank's place among its peers: its transfer engine, peer server and peer tier (worker process).

Started once the rank knows its KV layout (the identity peers must share
includes the layout tag): ``start_peer_node`` opens the transfer engine on
``p2p_host``, serves the CPU tier to peers on the rank's ports and appends
the ``PeerTier`` to the engine's tiers, so a load the scheduler planned
from a peer reads through it. Anything missing (the engine not installed, no
CPU tier, a port taken, no port listed for this rank) leaves the peer tier
off with one warning; the server keeps serving from its other tiers.
"""
from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

import zmq

from lmi_cache.config.peer import peer_ports
from lmi_cache.peer.client import PeerClient
from lmi_cache.peer.protocol import PeerIdentity
from lmi_cache.peer.server import PeerServer
from lmi_cache.peer.threads import run_unpinned
from lmi_cache.peer.tier import PeerTier
from lmi_cache.peer.transport import PeerTransport, TransportUnavailable

if TYPE_CHECKING:
    from lmi_cache.config.cache_config import CacheConfig
    from lmi_cache.engine import CacheEngine

logger = logging.getLogger(__name__)
DEFAULT_HOST = "127.0.0.1"


class PeerNode:
    """The rank's running peer parts; ``close`` stops serving peers (the engine closes the tier)."""

    def __init__(self, server: PeerServer, tier: PeerTier) -> None:
        self.server = server
        self.tier = tier

    def close(self) -> None:
        self.server.close()


def start_peer_node(config: CacheConfig, identity: PeerIdentity, rank: int, world_size: int,
                    engine: CacheEngine) -> PeerNode | None:
    ports = peer_ports(config, rank)
    if ports is None:
        logger.warning("lmi-cache: p2p_init_ports lists %d ports, rank %d has none: this rank's peer tier is off",
                       len(config.p2p_init_ports), rank)
        return None
    cpu = next((tier for tier in engine.tiers if tier.holds_host_buffers), None)
    if cpu is None:
        logger.warning("lmi-cache: enable_p2p needs a CPU tier (local_cpu, max_local_cpu_size): peer tier off")
        return None
    host = config.p2p_host or DEFAULT_HOST
    try:
        address = socket.gethostbyname(host)
        transport = run_unpinned(lambda: PeerTransport(address, config.peer_transport))
        init_ports = [p[0] for p in (peer_ports(config, r) for r in range(world_size)) if p is not None]
        server = PeerServer(identity, transport, cpu.peek, host=address, init_port=ports[0], lookup_port=ports[1],
                            init_ports=init_ports)
    except (TransportUnavailable, OSError, zmq.ZMQError) as err:
        logger.warning("lmi-cache: peer tier off on rank %d: %s", rank, err)
        return None
    metrics = engine.metrics

    def count_fault(reason: str) -> None:
        if reason == "corrupted":
            metrics.corrupted("peer")
        else:
            metrics.error("peer", reason)

    client = PeerClient(identity, transport, rank=rank, timeout_ms=config.peer_timeout_ms,
                        lease_ms=config.peer_lease_ms, allocate=engine.allocator.allocate,
                        recycle=engine.allocator.recycle, count_fault=count_fault)
    tier = PeerTier(client, engine.allocator)
    engine.tiers.append(tier)
    logger.info("lmi-cache: rank %d serves peers on %s:%d (lookups :%d, transfer engine %s over %s)", rank, host,
                ports[0], ports[1], transport.session_id, config.peer_transport)
    return PeerNode(server, tier)

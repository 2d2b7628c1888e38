"""Where a request's chunks may be read from a peer: the router's hint (scheduler and worker processes).

A router names the peer in the request, as vLLM's p2p tier takes it:
``kv_transfer_params: {"remote_kv_source": {"remote_host": H, "remote_port": P}}``,
where P is the peer's ``p2p_init_ports`` port of rank 0. A hint always
wins: a router that sends a prefix to a server knows (from the KV events
every server publishes) which server holds it. Without one, a server whose
remote tier is a Redis/Valkey store finds a holder through the records
every server keeps there (``lmi_cache.peer.holders``, which says why the
store and not the events); see docs/fleet.md.

A planned load from a peer names it in its source, ``peer@H:P``, so the
worker reads from the peer the scheduler asked (``source_tier`` strips it).
Plain Python: the engine imports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PEER = "peer"  # the tier's name in plans and metrics


@dataclass(frozen=True)
class PeerAddress:
    host: str
    init_port: int  # the peer's p2p_init_ports port of rank 0 (what a router's hint names)

    @property
    def text(self) -> str:
        return f"{self.host}:{self.init_port}"


def peer_hint(request: Any) -> PeerAddress | None:
    """The peer a request's ``kv_transfer_params`` names, or None (absent or malformed: no peer read)."""
    params = getattr(request, "kv_transfer_params", None)
    source = params.get("remote_kv_source") if isinstance(params, dict) else None
    if not isinstance(source, dict):
        return None
    host, port = source.get("remote_host"), source.get("remote_port")
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
        return None
    return PeerAddress(host, port)


def peer_source(peer: PeerAddress) -> str:
    return f"{PEER}@{peer.text}"


def source_tier(source: str) -> str:
    """The tier a load source names (``peer@H:P`` -> ``peer``)."""
    return source.split("@", 1)[0]


def source_peer(source: str) -> PeerAddress | None:
    tier, _, where = source.partition("@")
    host, _, port = where.rpartition(":")
    if tier != PEER or not host or not port.isdigit():
        return None
    return PeerAddress(host, int(port))

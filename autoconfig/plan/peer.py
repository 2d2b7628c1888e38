"""The peer tier's plan: ports per rank and the transfer engine's transport (container-start process).

Pure: the host facts come from the probe's snapshot (``rdma_drivers``: the
driver of each device under ``/sys/class/infiniband``). Each rank of a
replica gets two ports, a handshake port (``p2p_init_ports``, the one a
router's hint names for rank 0) and a lookup port (``p2p_lookup_ports``):
the user's, or 8200 + 2 x rank and the port after it. The transport is EFA
when an ``efa`` device is there, RDMA when another verbs device is, TCP
otherwise; ``extra_config.peer_transport`` carries it to the workers. Without
a router's hint, holders are found in ``peer_holders_url`` (a store for the
records alone), else in a Redis/Valkey remote store, else not at all; the
plan says which (``lmi_cache.config.peer.holder_records``, the engine's rule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoconfig.plan.settings import ServingSettings
from lmi_cache.config.peer import DEFAULT_INIT_PORT, HolderRecords
from lmi_cache.errors import UserError
from lmi_cache.remote.url import redact_url


class PeerPlanError(UserError):
    """P2P settings this deployment cannot run with."""


@dataclass(frozen=True)
class PeerPlan:
    host: str
    init_ports: tuple[int, ...]  # one per rank of a replica
    lookup_ports: tuple[int, ...]
    transport: str  # tcp | rdma | efa
    timeout_ms: int
    holders: HolderRecords | None = None  # where a request without a hint finds a holder (None: hints only)

    def to_dict(self) -> dict[str, Any]:
        holders = None if self.holders is None else {"url": redact_url(self.holders.url),
                                                      "store": "peer_holders_url" if self.holders.own else "remote_url"}
        return {"host": self.host, "init_ports": list(self.init_ports), "lookup_ports": list(self.lookup_ports),
                "transport": self.transport, "timeout_ms": self.timeout_ms, "holders": holders}

    def summary(self) -> str:
        """What ``plan``'s peer tier line and ``serve``'s cache line say of it."""
        return (f"on at {self.host}, ports {list(self.init_ports)} / {list(self.lookup_ports)}, over {self.transport}"
                f"; {holders_text(self.holders)}")

    def lmcache_keys(self) -> dict[str, Any]:
        return {"enable_p2p": True, "p2p_host": self.host, "p2p_init_ports": list(self.init_ports),
                "p2p_lookup_ports": list(self.lookup_ports), "transfer_channel": "mooncake"}


def pick_transport(rdma_drivers: list[str]) -> tuple[str, str]:
    """(transport, why) from the drivers of the host's verbs devices."""
    if any(driver == "efa" for driver in rdma_drivers):
        return "efa", "an EFA device is under /sys/class/infiniband"
    if rdma_drivers:
        return "rdma", f"verbs devices under /sys/class/infiniband ({', '.join(sorted(set(rdma_drivers)))})"
    return "tcp", "no RDMA or EFA device under /sys/class/infiniband"


def plan_peer(settings: ServingSettings, rdma_drivers: list[str], why: list[str], warn: list[str]) -> PeerPlan | None:
    """The peer tier's plan when ``option.lmcache_enable_p2p`` (or the LMCache key) asks for it, else None."""
    asked = settings.overrides
    if not asked.enable_p2p:
        if asked.peer_holders is not None and asked.peer_holders.own:
            warn.append("lmcache_peer_holders_url ignored: it is where the peer tier finds holders, and the peer "
                        "tier is off (set lmcache_enable_p2p=true)")
        return None
    if settings.engine != "lmi_cache":
        warn.append("lmcache_enable_p2p ignored: upstream LMCache's P2P needs its own controller; the peer tier is "
                    "lmi_cache's (option.lmcache_engine=lmi_cache)")
        return None
    ranks = settings.tp * settings.pp
    if settings.dp > 1:
        warn.append(f"enable_p2p with {settings.dp} data-parallel replicas: they share one config and so the peer "
                    "ports; only the replica that binds them first serves and reads peers (the others start "
                    "without the peer tier). Run one replica per server to share every replica's CPU tier")
    init, lookup, source = _ports(asked.p2p_init_ports, asked.p2p_lookup_ports, ranks)
    transport, reason = pick_transport(rdma_drivers)
    host = asked.p2p_host or "127.0.0.1"
    plan = PeerPlan(host, init, lookup, transport, asked.peer_timeout_ms or 2000, asked.peer_holders)
    why.append(f"peer tier = on (lmcache_enable_p2p): each rank serves its CPU tier to peers and reads a prefix a "
               f"request's router names (kv_transfer_params.remote_kv_source) from that peer; rank r handshakes on "
               f"p2p_init_ports[r] = {list(init)} and answers lookups on p2p_lookup_ports[r] = {list(lookup)} "
               f"({source}), at {host} (p2p_host{'' if asked.p2p_host else ': 127.0.0.1 reaches this host only'}); "
               f"transport {transport}: {reason}; a peer read gives up after {plan.timeout_ms} ms (peer_timeout_ms) "
               f"and vLLM recomputes; {_discovery_text(plan.holders)}")
    return plan


def holders_text(holders: HolderRecords | None) -> str:
    """Where holders are found, in a few words (the peer tier's line in ``plan`` and ``serve``)."""
    if holders is None:
        return "holders: router hints only"
    if holders.own:
        return f"holders: records in {redact_url(holders.url)} (peer_holders_url, no KV there)"
    return f"holders: records in the remote store {redact_url(holders.url)}"


def _discovery_text(holders: HolderRecords | None) -> str:
    """How a request with no hint finds a peer: through a Redis/Valkey store's holder records, or not at all."""
    if holders is None:
        return ("without a hint no peer is asked (lmcache_peer_holders_url, a Redis/Valkey for holder records "
                "only, or a Redis/Valkey lmcache_remote_url lets servers find holders)")
    if holders.own:
        return (f"without a hint, a holder is found through the records every server keeps in "
                f"{redact_url(holders.url)} (lmcache_peer_holders_url: holder records only, no KV is copied there; "
                "extra_config.peer_advertise)")
    return ("without a hint, a holder is found through the records every server keeps in the remote "
            "Redis/Valkey store (extra_config.peer_advertise; lmcache_peer_holders_url moves them to a store "
            "of their own)")


def _ports(init: tuple[int, ...] | None, lookup: tuple[int, ...] | None,
           ranks: int) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    if not init and not lookup:
        return (tuple(DEFAULT_INIT_PORT + 2 * r for r in range(ranks)),
                tuple(DEFAULT_INIT_PORT + 2 * r + 1 for r in range(ranks)), f"{DEFAULT_INIT_PORT} + 2 x rank")
    if not init or not lookup or len(init) < ranks or len(lookup) < ranks:
        raise PeerPlanError(f"p2p_init_ports and p2p_lookup_ports (option.lmcache_p2p_*) need one port per rank "
                            f"({ranks}: tp x pp) each; got {len(init or ())} and {len(lookup or ())}")
    if set(init) & set(lookup):
        raise PeerPlanError("p2p_init_ports and p2p_lookup_ports (option.lmcache_p2p_*) share a port; "
                            "give each its own")
    return init[:ranks], lookup[:ranks], "as given"

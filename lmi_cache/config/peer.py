"""The peer tier's configuration keys (torch-free; any process).

LMCache's P2P keys, with lmi_cache's meaning:

- ``enable_p2p``: serve this server's CPU tier to peers and read chunks from
  a peer a request's router names (``kv_transfer_params.remote_kv_source``).
- ``p2p_host``: the address peers reach this server at (its ZMQ sockets and
  transfer engine bind there); default ``127.0.0.1`` is for one host only.
- ``p2p_init_ports``: one port per rank (rank r: the r-th), where a peer's
  handshake arrives; a router's hint names rank 0's. Without it (and
  without ``p2p_lookup_ports``) rank r uses 8200 + 2r and the port after it.
- ``p2p_lookup_ports``: one port per rank, where peers ask for chunks under a lease.
- ``transfer_channel``: LMCache picks its transfer library with it; the
  peer tier always moves bytes with Mooncake's transfer engine, so only
  ``mooncake`` (or nothing) is taken, other values warn.

lmi_cache's ``extra_config`` keys: ``peer_transport`` (``tcp``, ``rdma`` or
``efa``: the engine's transport; autoconfig picks it from the probe),
``peer_timeout_ms`` (a peer read gives up after this and vLLM recomputes;
default 2000), ``peer_lease_ms`` (how long a peer keeps chunks pinned for a
reader that never says it is done; default 5000), ``peer_advertise`` (with a
Redis/Valkey ``remote_url`` too, write "chunk -> this server" records into
that store so peers find chunks without a router's hint; default true:
``lmi_cache.peer.holders``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmi_cache.config.values import parse_bool, parse_int, parse_optional_str, show
from lmi_cache.errors import ConfigError

if TYPE_CHECKING:
    from lmi_cache.config.cache_config import CacheConfig

PEER_EXTRA_KEYS = ("peer_transport", "peer_timeout_ms", "peer_lease_ms", "peer_advertise")
PEER_TRANSPORTS = ("tcp", "rdma", "efa")
TRANSFER_CHANNELS = ("mooncake",)
MAX_PEER_TIMEOUT_MS = 600_000
MAX_PORT = 65535
# Without p2p_*_ports, rank r takes DEFAULT_INIT_PORT + 2r for its handshake and the port after it for lookups.
DEFAULT_INIT_PORT = 8200


def parse_ports(value: Any, where: str) -> tuple[int, ...]:
    """One port or a list of ports (YAML list, ``8200,8201`` or ``[8200, 8201]`` from env or properties)."""
    if value is None:
        return ()
    items: list[Any]
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        items = [part for part in value.strip().strip("[]").replace(" ", "").split(",") if part]
    else:
        items = [value]
    ports = tuple(parse_int(item, where, minimum=1, maximum=MAX_PORT) for item in items)
    if len(set(ports)) != len(ports):
        raise ConfigError(f"{where}: a port is listed twice in {show(value)}; give each rank its own port")
    return ports


def parse_transfer_channel(value: Any, where: str, warnings: list[str]) -> str | None:
    name = parse_optional_str(value, where)
    if name is not None and name.lower() not in TRANSFER_CHANNELS:
        warnings.append(f"{where}: transfer_channel {name} is not used by lmi_cache: its peer tier moves KV with "
                        "Mooncake's transfer engine (transfer_channel: mooncake)")
        return None
    return None if name is None else name.lower()


def parse_peer_extra(key: str, value: Any, where: str) -> Any:
    if key == "peer_transport":
        name = str(value).strip().lower()
        if name not in PEER_TRANSPORTS:
            raise ConfigError(f"{where}: expected one of {', '.join(PEER_TRANSPORTS)}, got {show(value)}")
        return name
    if key in ("peer_timeout_ms", "peer_lease_ms"):
        return parse_int(value, where, minimum=1, maximum=MAX_PEER_TIMEOUT_MS)
    if key == "peer_advertise":
        return parse_bool(value, where)
    raise KeyError(key)


def peer_ports(config: CacheConfig, rank: int) -> tuple[int, int] | None:
    """Rank ``rank``'s (init, lookup) ports, or None when the lists name fewer ranks."""
    if not config.p2p_init_ports:
        return DEFAULT_INIT_PORT + 2 * rank, DEFAULT_INIT_PORT + 2 * rank + 1
    if rank >= len(config.p2p_init_ports):
        return None
    return config.p2p_init_ports[rank], config.p2p_lookup_ports[rank]


def check_peer(config: CacheConfig, source: str) -> None:
    """ConfigError for P2P settings a server cannot start with (ports missing, lists that do not pair up)."""
    if not config.enable_p2p:
        return
    if bool(config.p2p_init_ports) != bool(config.p2p_lookup_ports):
        given = "p2p_init_ports" if config.p2p_init_ports else "p2p_lookup_ports"
        raise ConfigError(f"{source}: enable_p2p with {given} but not the other; give both (one port per rank "
                          f"each), or neither to use {DEFAULT_INIT_PORT} + 2 x rank and the port after it")
    if len(config.p2p_init_ports) != len(config.p2p_lookup_ports):
        raise ConfigError(f"{source}: p2p_init_ports has {len(config.p2p_init_ports)} ports and p2p_lookup_ports "
                          f"{len(config.p2p_lookup_ports)}; give both one port per rank")
    shared = set(config.p2p_init_ports) & set(config.p2p_lookup_ports)
    if shared:
        raise ConfigError(f"{source}: port {min(shared)} is in both p2p_init_ports and p2p_lookup_ports; "
                          "give each its own port")
    if config.peer_lease_ms < config.peer_timeout_ms:
        raise ConfigError(f"{source}: extra_config.peer_lease_ms ({config.peer_lease_ms}) is shorter than "
                          f"peer_timeout_ms ({config.peer_timeout_ms}); a lease must outlive the read it covers")

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
reader that never says it is done; default 5000), ``peer_advertise`` (write
"chunk -> this server" records into the holder store so peers find chunks
without a router's hint; default true: ``lmi_cache.peer.holders``) and
``peer_holders_url`` (a Redis/Valkey that holds only those records).

The holder store is ``peer_holders_url`` when set, else a Redis/Valkey
``remote_url``; with neither, only a router's hint finds a peer. A store of its
own lets a fleet share KV peer to peer without the remote tier, which writes a
second copy of every chunk to its store; it is read with the remote tier's
settings (``lookup_timeout_ms``, ``remote_key_prefix``, ``remote_cluster``,
credentials from the environment) so one reading serves both clients.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from lmi_cache.config.values import parse_bool, parse_int, parse_optional_str, show
from lmi_cache.errors import ConfigError
from lmi_cache.remote.url import REDIS_SCHEMES, parse_remote_url

if TYPE_CHECKING:
    from lmi_cache.config.cache_config import CacheConfig
    from lmi_cache.remote.settings import RemoteSettings

PEER_EXTRA_KEYS = ("peer_transport", "peer_timeout_ms", "peer_lease_ms", "peer_advertise", "peer_holders_url")
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
    if key == "peer_holders_url":
        return parse_holders_url(value, where)
    raise KeyError(key)


def parse_holders_url(value: Any, where: str) -> str | None:
    """A Redis/Valkey URL (checked as ``remote_url`` is); ConfigError naming ``where``, never echoing the URL."""
    url = parse_optional_str(value, where)
    if url is None:
        return None
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        shown = f"{scheme[:20]}://" if scheme else "a value without a scheme://"
        raise ConfigError(f"{where}: holder records live in Redis or Valkey, not {shown}; use "
                          f"{', '.join(s + '://' for s in REDIS_SCHEMES)}")
    try:
        parse_remote_url(url, "peer_holders_url")  # where the store is: host, port, socket path
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return url


class HolderRecords(NamedTuple):
    """Where the peer tier keeps its holder records: a store of their own, or the remote tier's."""

    url: str  # may hold credentials: show ``redact_url(url)``
    own: bool  # True: peer_holders_url (records only, no KV); False: the remote tier's Redis/Valkey


def holder_records(peer_holders_url: str | None, remote_url: str | None) -> HolderRecords | None:
    """The one rule the engine and the planner follow; None: only a router's hint finds a peer."""
    if peer_holders_url:
        return HolderRecords(peer_holders_url, True)
    if remote_url and parse_remote_url(remote_url).scheme in REDIS_SCHEMES:
        return HolderRecords(remote_url, False)
    return None


def holder_settings(config: CacheConfig, source: str) -> tuple[RemoteSettings, bool] | None:
    """The holder store's client settings and whether it is a store of its own, or None (hints only)."""
    from lmi_cache.config.remote import store_settings

    records = holder_records(config.peer_holders_url, config.remote_url)
    if records is None:
        return None
    return store_settings(config, records.url, source), records.own


def peer_ports(config: CacheConfig, rank: int) -> tuple[int, int] | None:
    """Rank ``rank``'s (init, lookup) ports, or None when the lists name fewer ranks."""
    if not config.p2p_init_ports:
        return DEFAULT_INIT_PORT + 2 * rank, DEFAULT_INIT_PORT + 2 * rank + 1
    if rank >= len(config.p2p_init_ports):
        return None
    return config.p2p_init_ports[rank], config.p2p_lookup_ports[rank]


def check_peer(config: CacheConfig, source: str) -> list[str]:
    """ConfigError for P2P settings a server cannot start with (ports missing, lists that do not pair up);
    returns warnings for settings that do nothing."""
    if not config.enable_p2p:
        if config.peer_holders_url:
            return [f"{source}: extra_config.peer_holders_url is set but enable_p2p is off: no holder records "
                    "are kept or read"]
        return []
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
    holder_settings(config, source)  # a holder store the client cannot use is an error now, not at the first lookup
    return []

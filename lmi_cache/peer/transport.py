"""The transfer engine under the peer tier: Mooncake's Transfer Engine, wrapped (worker process).

Why a wrapper: the engine is an optional native package that needs
``libibverbs`` at import even for TCP; a server without it must start with
the peer tier off and one line saying why, never a traceback. Every call
into the engine is here, so the rest of the peer tier speaks addresses and
lengths only.

Peers find each other's engine without etcd (``P2PHANDSHAKE`` metadata): an
engine listens on a port it picks itself, and its session id
(``host:rpc_port``) travels in the peer handshake. Registration is counted
per address: a chunk buffer leased to two readers at once is registered once
and unregistered when the last lease ends.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Transports the engine speaks that the plan may choose; "tcp" works everywhere.
TRANSPORTS = ("tcp", "rdma", "efa")


class TransportUnavailable(RuntimeError):
    """The transfer engine cannot run here (not installed, a system library missing, init failed)."""


def _engine_class() -> Any:
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the engine logs every connection at INFO otherwise
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as err:
        missing = str(err)
        hint = ("install Debian's libibverbs1 librdmacm1 libnuma1 (scripts/setup.sh does)" if ".so" in missing
                else "pip install 'lmi-cache[peer]' (mooncake-transfer-engine-non-cuda)")
        raise TransportUnavailable(f"the Mooncake transfer engine cannot be imported ({missing}); {hint}") from None
    return TransferEngine


def transport_available() -> str | None:
    """None when the engine imports here, else the one-line reason it does not."""
    try:
        _engine_class()
    except TransportUnavailable as err:
        return str(err)
    return None


class PeerTransport:
    """One Mooncake engine: registers local memory and reads registered memory of peers' engines."""

    def __init__(self, host: str, protocol: str = "tcp", device: str = "") -> None:
        if protocol not in TRANSPORTS:
            raise TransportUnavailable(f"unknown peer transport {protocol!r}; use one of {', '.join(TRANSPORTS)}")
        engine = _engine_class()()
        status = engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if status != 0:
            raise TransportUnavailable(f"the transfer engine did not start on {host} over {protocol} (status {status})")
        self._engine = engine
        self.host = host
        self.protocol = protocol
        self.session_id = f"{host}:{engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # address -> leases that registered it

    def register(self, address: int, length: int) -> bool:
        with self._lock:
            count = self._registered.get(address, 0)
            if count == 0 and self._engine.register_memory(address, length) != 0:
                return False
            self._registered[address] = count + 1
            return True

    def unregister(self, address: int) -> None:
        with self._lock:
            count = self._registered.get(address, 0)
            if count <= 1:
                self._registered.pop(address, None)
                if count == 1:
                    self._engine.unregister_memory(address)
            else:
                self._registered[address] = count - 1

    @property
    def num_registered(self) -> int:
        with self._lock:
            return len(self._registered)

    def read(self, session_id: str, local_addresses: Sequence[int], remote_addresses: Sequence[int],
             lengths: Sequence[int]) -> bool:
        """Read each remote range into its local one (blocking; the caller bounds the wait). True when all landed."""
        if not lengths:
            return True
        status = self._engine.batch_transfer_sync_read(session_id, list(local_addresses), list(remote_addresses),
                                                       list(lengths))
        return bool(status == 0)

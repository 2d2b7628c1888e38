"""PeerHolders: which servers' CPU tiers hold a chunk, kept in the fleet's shared Redis/Valkey (scheduler process).

Without a router's hint a server still finds a peer that holds a prefix when
the peer tier has a holder store: ``extra_config.peer_holders_url`` (a
Redis/Valkey for these records only, so no KV is copied to it) or else a
Redis/Valkey ``remote_url`` (``lmi_cache.config.peer.holder_records``). Every server
advertises each chunk its CPU tier holds (rank 0's entry, once its worker
confirms it) as one field of a hash per chunk digest:
``<remote_key_prefix>:peer:v1:<digest hex>`` -> ``{"host:port": expiry}``,
where ``host:port`` is its ``p2p_host`` and rank 0's ``p2p_init_ports`` port
(what a router's hint would name) and ``expiry`` the Unix time the field
stops counting (``HOLDER_TTL_S`` ahead; the key expires then too, and every
holder's write extends it). Held chunks are advertised again every third of
the TTL, so their records outlive it. A chunk the placement directory evicts
from the CPU tier (or a worker loses) is withdrawn: its field is deleted. A
hash per chunk lets several servers hold one chunk, each withdrawing only its
own field; the digest already names everything the chunk key covers (model,
KV dtype, layout, TP/PP size, LoRA, salt), so servers that could not share a
chunk never name the same record.

Writes are noted by the scheduler as its workers report and sent from a
background thread in pipelined round trips (coalesced: a chunk stored and
evicted before the write goes out costs nothing), never waited for. A store that is down drops them,
and the first write after it answers again re-advertises everything held.
A lookup is one pipelined HGETALL of the chunks' rank-0 digests on a client
with the remote tier's ``lookup_timeout_ms``; expired fields and this
server's own address are ignored.

Everything here is best effort. A stale record (a lost withdrawal, a holder
that stopped) costs the reader one question: ``PeerLookups`` asks the named
peer which chunks it holds before anything is planned from it, and a read
leases each chunk, so a chunk the peer no longer holds is a miss; a holder
that does not answer is skipped for a while.

Why the shared store and not the KV events every server publishes: a reader
of events must subscribe to every server and keep the fleet's state as it
changes (a router's job, with a process of its own); the store is already
there for the remote tier, keeps the state itself, and a lookup is one round
trip. A fleet that wants no second copy of its KV runs a small Valkey for the
records alone (``peer_holders_url``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.peer.control import PeerFault
from lmi_cache.peer.hint import PeerAddress
from lmi_cache.remote.store import Backoff, StoreError
from lmi_cache.remote.value_codec import KEY_VERSION
from lmi_cache.thread_affinity import unpin_current_thread

if TYPE_CHECKING:
    from lmi_cache.config.cache_config import CacheConfig

logger = logging.getLogger(__name__)

HOLDER_TTL_S = 300  # a record of a server that stopped stops counting after this
# Changes waiting for the store beyond this (an outage): dropped, and everything held is sent again later.
MAX_PENDING = 1 << 16
NO_HOLDER = "no_holder"  # lookup outcome: the store names no other server for the first chunk
STORE_DOWN = "store_down"  # lookup outcome: the store did not answer


# The tier peers read from (the peer server serves the CPU tier), so the one the holder records describe.
ADVERTISED_TIER = "cpu"


class _Placed(Protocol):
    """A directory entry as the scheduler sees it in evictions and worker reports."""

    @property
    def digest(self) -> bytes: ...

    @property
    def tier(self) -> str: ...


class HolderStore(Protocol):
    """What PeerHolders needs of the store (``lmi_cache.remote.redis_store.RedisStore``)."""

    key_prefix: str

    def pipeline(self, commands: Callable[[Any], object], *, lookup: bool) -> list[Any]: ...

    def close(self) -> None: ...


class PeerHolders:
    """See the module docstring. Thread-safe; the scheduler notes and flushes, lookup threads ask."""

    def __init__(self, store: HolderStore, own: PeerAddress, *, advertise: bool, timeout_ms: int,
                 ttl_s: int = HOLDER_TTL_S, backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0) -> None:
        self.own = own
        self.advertise = advertise
        self.timeout_ms = timeout_ms  # a lookup gives up after this (the store's lookup client's timeout)
        self._store = store
        self._ttl_s = ttl_s
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._warner = RateLimitedWarner(logger)
        self._held: dict[bytes, None] = {}  # rank-0 digests this server advertises
        self._pending: dict[bytes, bool] = {}  # digest -> advertise (True) or withdraw (False), not sent yet
        self._refresh_at = time.monotonic() + ttl_s / 3
        self._resend_all = False  # a write failed: send everything held with the next one
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmi-peer-holders",
                                          initializer=unpin_current_thread)
        self._writing = False  # a drain runs on the writer thread

    def name_for(self, digest: bytes) -> str:
        return f"{self._store.key_prefix}:peer:{KEY_VERSION}:{digest.hex()}"

    # -- advertising (the scheduler thread notes, the writer thread sends) ------------------

    def held(self, digests: Sequence[bytes]) -> None:
        """These rank-0 digests are now in this server's CPU tier."""
        if self.advertise:
            with self._lock:
                for digest in digests:
                    self._held[digest] = None
                    self._pending[digest] = True

    def gone(self, digests: Sequence[bytes]) -> None:
        """These left the CPU tier (evicted, demoted, lost): withdraw the ones advertised."""
        with self._lock:
            for digest in digests:
                if digest in self._held:
                    del self._held[digest]
                    self._pending[digest] = False

    def note_evictions(self, evictions: Iterable[_Placed]) -> None:
        """The directory's evictions and demotions of rank 0 this step: withdraw those from the CPU tier."""
        self.gone([e.digest for e in evictions if e.tier == ADVERTISED_TIER])
        self.flush()

    def note_reports(self, stored: Iterable[_Placed], lost: Iterable[_Placed],
                     still_held: Callable[[bytes], bool]) -> None:
        """Rank 0's worker reports: CPU-tier stores the directory still holds are advertised, losses withdrawn
        (a peer asks every rank before it reads, so rank 0 stands for the server)."""
        self.held([e.digest for e in stored if e.tier == ADVERTISED_TIER and still_held(e.digest)])
        self.gone([e.digest for e in lost if e.tier == ADVERTISED_TIER])
        self.flush()  # now: the step that confirmed a request's last chunks may be the server's last

    def flush(self) -> None:
        """Start sending what changed (every third of the TTL: everything held); never waits. A write in flight
        sends what is noted meanwhile when it is done."""
        if not self.advertise:
            return
        with self._lock:
            now = time.monotonic()
            if now >= self._refresh_at or self._resend_all:
                self._refresh_at, self._resend_all = now + self._ttl_s / 3, False
                self._pending.update(dict.fromkeys(self._held, True))
            if self._writing or not self._pending:
                return
            if not self._backoff.allow():
                if len(self._pending) > MAX_PENDING:
                    self._pending.clear()  # lost withdrawals leave stale records: a miss for whoever reads them
                    self._resend_all = True
                return
            self._writing = True
        try:
            self._writer.submit(self._drain)
        except RuntimeError:  # closed
            pass

    def _drain(self) -> None:
        while True:
            with self._lock:
                batch, self._pending = self._pending, {}
                if not batch:
                    self._writing = False
                    return
            if not self._write(batch):
                with self._lock:
                    self._writing = False
                return

    def _write(self, batch: Mapping[bytes, bool]) -> bool:
        own, ttl_s = self.own.text, self._ttl_s
        expiry = int(time.time()) + ttl_s

        def commands(pipe: Any) -> None:
            for digest, advertise in batch.items():
                name = self.name_for(digest)
                if advertise:
                    pipe.hset(name, own, expiry)
                    pipe.expire(name, ttl_s)
                else:
                    pipe.hdel(name, own)

        try:
            self._store.pipeline(commands, lookup=False)
        except StoreError as err:
            with self._lock:
                self._resend_all = True  # the batch is dropped; what is still held goes with the next write
            if self._backoff.failed():
                self._warner.warn("holders-write", f"lmi-cache: peer holder records not written ({err}); peers "
                                                   "find this server's chunks only by hints until the store answers")
            return False
        self._backoff.succeeded()
        return True

    # -- lookups (any thread) ------------------------------------------------------------

    def holders_of(self, digests: Sequence[bytes]) -> list[dict[PeerAddress, int]]:
        """Per rank-0 digest, the other servers advertising it (-> their fields' expiry); one round trip.
        PeerFault(``store_down``) when the store does not answer (or is backed off)."""
        if not digests:
            return []
        if not self._backoff.allow():
            raise PeerFault(STORE_DOWN, "the shared store is backed off")
        try:
            replies = self._store.pipeline(lambda pipe: [pipe.hgetall(self.name_for(d)) for d in digests],
                                           lookup=True)
        except StoreError as err:
            self._backoff.failed()
            raise PeerFault(STORE_DOWN, str(err)) from None
        self._backoff.succeeded()
        now = int(time.time())
        return [self._parse(reply, now) for reply in replies]

    def _parse(self, reply: Any, now: int) -> dict[PeerAddress, int]:
        found: dict[PeerAddress, int] = {}
        for field, value in (reply.items() if isinstance(reply, dict) else ()):
            try:
                host, _, port = _text(field).rpartition(":")
                peer, expiry = PeerAddress(host, int(port)), int(_text(value))
            except (ValueError, UnicodeDecodeError):
                continue  # not a record of ours
            if host and 0 < peer.init_port < 65536 and expiry >= now and peer != self.own:
                found[peer] = expiry
        return found

    def close(self) -> None:
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._store.close()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def choose_holder(found: Sequence[Mapping[PeerAddress, int]], skip: Container[PeerAddress]) -> PeerAddress | None:
    """The server advertising the longest run of the leading entries (ties: the latest advertised), or None."""
    best: tuple[int, int] = (0, 0)
    chosen: PeerAddress | None = None
    for peer, expiry in (found[0] if found else {}).items():
        if peer in skip:
            continue
        run = 1
        while run < len(found) and peer in found[run]:
            run += 1
        if (run, expiry) > best:
            best, chosen = (run, expiry), peer
    return chosen


def open_peer_holders(config: CacheConfig) -> PeerHolders | None:
    """The holder records of a server with the peer tier, in ``peer_holders_url`` or a Redis/Valkey remote
    tier's store, or None (then only a router's hint finds a peer). Connects on first use: a store that is
    down costs misses, not a failed start."""
    if not config.enable_p2p:
        return None
    from lmi_cache.config.peer import holder_settings, peer_ports

    found = holder_settings(config, "lmi-cache config")
    if found is None:
        logger.info("lmi-cache: peers are found by routers' hints only (holder records need "
                    "extra_config.peer_holders_url or a Redis/Valkey remote_url)")
        return None
    settings, own = found
    from lmi_cache.peer.node import DEFAULT_HOST
    from lmi_cache.remote.redis_store import RedisStore

    ports = peer_ports(config, 0)
    assert ports is not None, "rank 0 always has peer ports"
    address = PeerAddress(config.p2p_host or DEFAULT_HOST, ports[0])
    holders = PeerHolders(RedisStore(settings), address, advertise=config.peer_advertise,
                          timeout_ms=settings.lookup_timeout_ms, backoff_initial_s=settings.backoff_initial_s,
                          backoff_max_s=settings.backoff_max_s)
    where = f"{settings.display_url} ({'peer_holders_url' if own else 'the remote tier store'})"
    if config.peer_advertise:
        logger.info("lmi-cache: peers find this server's CPU-tier chunks in %s as %s%s", where, address.text,
                    "" if config.p2p_host else " (p2p_host unset: reachable from this host only)")
    else:
        logger.info("lmi-cache: peer_advertise is off: this server looks up holders in %s but names none", where)
    return holders

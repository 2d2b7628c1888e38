"""PeerLookups: the scheduler's asynchronous question "which of these chunks does that peer hold?" (scheduler).

Shaped like the remote store's existence check (``RemoteCache.has_many_async``):
``ask`` returns at once with a pending answer that ``poll`` reads (None while
in flight), so vLLM's scheduler never waits on a peer; it answers "not yet"
and asks again next step. The question goes to every rank of the peer (rank
r's keys to its rank r) on a small thread pool, nothing is pinned (the
worker leases chunks when it reads them), and it gives up after
``timeout_ms``: every chunk is then a miss, with the outcome counted
(answered, timeout, unreachable, refused, bad_reply).

Without a hint, with the fleet's shared store keeping holder records
(``lmi_cache.peer.holders``), ``discover`` first asks the store which other
server holds the leading chunks (one round trip, bounded by the store's
lookup timeout), then asks that server as above: a stale record is a miss
there, never a planned load (outcomes no_holder and store_down besides). A
holder that did not answer, or refused us, is passed over for ``DOWN_FOR_S``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.peer.control import PeerControl, PeerFault
from lmi_cache.peer.hint import PeerAddress
from lmi_cache.peer.holders import NO_HOLDER, PeerHolders, choose_holder
from lmi_cache.peer.protocol import PeerIdentity
from lmi_cache.thread_affinity import unpin_current_thread


logger = logging.getLogger(__name__)
DOWN_FOR_S = 30.0  # a holder the store named that did not answer is not chosen again for this long


class PendingPeerLookup:
    """One in-flight question; ``poll()``: per key, whether the peer holds it, or None while asked. ``peer``: the
    peer asked (the hint's; for ``discover``, the holder the store named, known once answered)."""

    def __init__(self, future: Future[tuple[PeerAddress, list[bool]]], num_keys: int, deadline: float,
                 peer: PeerAddress | None, warner: RateLimitedWarner) -> None:
        self._future = future
        self.peer = peer
        self._warner = warner
        self._num_keys = num_keys
        self._deadline = deadline
        self.outcome = "answered"

    def poll(self) -> list[bool] | None:
        if self._future.done():
            try:
                self.peer, held = self._future.result()
                return held
            except PeerFault as fault:
                return self._miss(fault.reason, str(fault))
            except Exception as err:  # noqa: BLE001 - any fault of the question is a miss
                return self._miss("bad_reply", repr(err))
        if time.monotonic() > self._deadline:
            return self._miss("timeout", "no answer in time")
        return None

    def _miss(self, outcome: str, detail: str) -> list[bool]:
        self.outcome = outcome
        if outcome != NO_HOLDER:  # no other server holds the prefix: the usual case, not a fault
            who = f"peer {self.peer.text}" if self.peer is not None else "the shared store's holder of a prefix"
            self._warner.warn(f"peer-{outcome}", f"lmi-cache: {who} not asked ({detail}); its chunks are misses")
        return [False] * self._num_keys


class PeerLookups:
    """See the module docstring. The identity is known once the workers report their KV layout."""

    def __init__(self, timeout_ms: int, world_size: int, holders: PeerHolders | None = None) -> None:
        self.timeout_ms = timeout_ms
        self.holders = holders  # None: only a router's hint finds a peer
        self._world_size = world_size
        self._down: dict[PeerAddress, float] = {}  # holders that did not answer -> until when they are passed over
        self._control: PeerControl | None = None
        self._warner = RateLimitedWarner(logger)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmi-peer-lookup",
                                        initializer=unpin_current_thread)

    def set_identity(self, identity: PeerIdentity) -> None:
        self._control = PeerControl(identity)

    def ask(self, peer: PeerAddress, keys: Sequence[ChunkKey]) -> PendingPeerLookup:
        """``keys``: flat, every rank's key of a chunk in rank order, chunk after chunk."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        future = self._pool.submit(lambda: (peer, self._ask(peer, list(keys), deadline)))
        return PendingPeerLookup(future, len(keys), deadline, peer, self._warner)

    def discover(self, keys: Sequence[ChunkKey]) -> PendingPeerLookup:
        """``ask`` the server the shared store names as holding the leading chunks (needs ``holders``)."""
        assert self.holders is not None, "no holder records"
        deadline = time.monotonic() + (self.holders.timeout_ms + self.timeout_ms) / 1000
        future = self._pool.submit(self._discover, list(keys), deadline)
        return PendingPeerLookup(future, len(keys), deadline, None, self._warner)

    def _discover(self, keys: list[ChunkKey], deadline: float) -> tuple[PeerAddress, list[bool]]:
        assert self.holders is not None
        found = self.holders.holders_of([key.digest for key in keys[:: self._world_size]])  # rank 0's entries
        now = time.monotonic()
        peer = choose_holder(found, {p for p, until in list(self._down.items()) if until > now})
        if peer is None:
            raise PeerFault(NO_HOLDER, "no other server holds the first chunk")
        try:
            return peer, self._ask(peer, keys, deadline)
        except PeerFault as fault:
            if fault.reason in ("unreachable", "timeout", "refused"):  # refused: another model or layout
                self._down[peer] = time.monotonic() + DOWN_FOR_S
            raise

    def _ask(self, peer: PeerAddress, keys: list[ChunkKey], deadline: float) -> list[bool]:
        control = self._control
        if control is None:
            raise PeerFault("refused", "this server's KV layout is not known yet")
        held = [False] * len(keys)
        try:
            for rank in range(self._world_size):
                positions = list(range(rank, len(keys), self._world_size))
                link = control.link(peer, rank, deadline)
                reply = control.ask(link.lookup, {"op": "has", "digests": [keys[i].digest for i in positions]},
                                    deadline)
                answer = reply.get("held")
                if not isinstance(answer, list) or len(answer) != len(positions):
                    raise PeerFault("bad_reply", "has answer does not fit the question")
                for position, flag in zip(positions, answer):
                    held[position] = flag is True
        except PeerFault as fault:
            if fault.reason in ("unreachable", "timeout"):
                control.forget(peer)
            raise
        return held

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.holders is not None:
            self.holders.close()

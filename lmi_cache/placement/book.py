"""One tier's page of the placement directory: which digests it holds, within which budgets (scheduler process).

Torch-free bookkeeping, no I/O. A tier (the CPU tier, the disk tier) has one
byte budget per rank, and the disk tier one per directory of each rank (a
chunk's directory is chosen by its digest, as the disk tier chooses it:
``tiers.disk.index.shard_index``). An entry is *pending* from the step its
store is planned until a worker confirms it, then *ready*; only ready
entries are hits, pending ones already take their bytes, so two stores
planned in one step never overfill a budget.

Eviction order is the tier's ``cache_policy`` (LRU or FIFO), with open
sessions' chunks evicted last within ``session_retention_share`` of the CPU
tier (``eviction.retaining``); each budget evicts in that order (``budget``).
Entries loaded or stored in the step being planned are pinned: a store never
evicts what the same step reads or writes.
A lease (``lease``/``end_lease``) pins an entry across steps, for a reader
outside the step (a peer server reading a CPU chunk).

This is the only budget-and-evict implementation: the workers' tiers hold what
they are told, with sizes from ``tiers.entry_sizes`` (the same functions the
specs here name).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from lmi_cache.eviction import EvictionPolicy, make_policy
from lmi_cache.eviction.retaining import RetainingPolicy
from lmi_cache.placement.budget import Budget, Victim
from lmi_cache.placement.recent_digests import RecentDigests
from lmi_cache.tiers.disk.index import shard_index  # a chunk's disk directory, as the disk tier picks it

# Budget bytes of an entry from its payload bytes (the tier's own rounding: allocator size class, file blocks).
EntryBytes = Callable[[int], int]
# Pending entries evicted before their store was confirmed, remembered (this many) until the confirmation comes.
EVICTED_PENDING_DIGESTS = 65536


@dataclass(frozen=True)
class TierSpec:
    """A local tier as the directory budgets it (per rank; the workers' tiers have the same budgets)."""

    name: str
    capacity_bytes: int
    entry_bytes: EntryBytes
    num_shards: int = 1
    policy: str = "LRU"
    retention_share: float = 0.0  # the CPU tier: open sessions' chunks are evicted last within this share


class TierBook:
    """What one local tier holds, on every rank; see the module docstring."""

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self._budgets: dict[tuple[int, int], Budget] = {}
        self._where: dict[bytes, tuple[int, int]] = {}  # digest -> (rank, shard)
        self._pinned: set[bytes] = set()
        self._leased: dict[bytes, int] = {}  # digest -> open leases (pinned across steps)
        self._retaining: dict[tuple[int, int], RetainingPolicy] = {}
        self._sessions: dict[str, list[bytes]] = {}  # open sessions' digests, for budgets made later
        # Evicted while pending: a store confirmed after its eviction (asynchronous scheduling plans a step
        # before the previous one reports) was planned, not a stray.
        self._evicted_pending = RecentDigests(EVICTED_PENDING_DIGESTS)

    @property
    def name(self) -> str:
        return self.spec.name

    def _budget(self, rank: int, shard: int) -> Budget:
        budget = self._budgets.get((rank, shard))
        if budget is None:
            spec = self.spec
            policy: EvictionPolicy = make_policy(spec.policy)
            retaining: RetainingPolicy | None = None
            if spec.retention_share > 0:
                retaining = RetainingPolicy(policy, int(spec.capacity_bytes // spec.num_shards * spec.retention_share),
                                            lambda digest: budget.size_of(digest) if budget is not None else None)
                policy = retaining
            budget = Budget(spec.capacity_bytes // spec.num_shards, policy, self._pinned, self._leased)
            self._budgets[(rank, shard)] = budget
            if retaining is not None:
                self._retaining[(rank, shard)] = retaining
                for session, digests in self._sessions.items():
                    retaining.retain(session, digests)
        return budget

    def shard_of(self, digest: bytes) -> int:
        return shard_index(digest, self.spec.num_shards) if self.spec.num_shards > 1 else 0

    # -- questions ------------------------------------------------------------------------

    def holds(self, digest: bytes) -> bool:
        """Ready (stored and confirmed) on its rank."""
        where = self._where.get(digest)
        return where is not None and self._budgets[where].entries[digest].ready

    def knows(self, digest: bytes) -> bool:
        """Ready or pending."""
        return digest in self._where

    def __len__(self) -> int:
        return len(self._where)

    def digests(self) -> set[bytes]:
        return set(self._where)

    # -- changes --------------------------------------------------------------------------

    def reserve(self, rank: int, digest: bytes, payload_bytes: int) -> list[Victim] | None:
        """Room for a pending entry: the entries evicted for it, or None when it does not fit now."""
        if digest in self._where:
            self.touch(digest)
            return []
        return self._admit(rank, digest, self.spec.entry_bytes(payload_bytes), payload_bytes, ready=False)

    def _admit(self, rank: int, digest: bytes, size_bytes: int, payload_bytes: int, ready: bool,
               shard: int | None = None) -> list[Victim] | None:
        shard = self.shard_of(digest) if shard is None else shard
        budget = self._budget(rank, shard)
        victims = budget.admit(digest, size_bytes, payload_bytes, ready)
        if victims is None:
            return None
        self._taken(budget, victims)
        self._where[digest] = (rank, shard)
        return victims

    def _taken(self, budget: Budget, victims: list[Victim]) -> None:
        """``victims`` left ``budget``: forget where they were, remember those evicted while pending."""
        for victim, _ in victims:
            del self._where[victim]
        self._evicted_pending.admit(budget.evicted_pending)
        budget.evicted_pending.clear()

    def adopt(self, rank: int, shard: int, digest: bytes, size_bytes: int) -> list[Victim]:
        """A ready entry found at start-up (disk files, oldest first); the older entries evicted for it (over the
        budget: the directory tells the worker to delete them). An entry larger than the budget is itself
        returned as a victim."""
        if digest in self._where:
            return []
        victims = self._admit(rank, digest, size_bytes, size_bytes, ready=True, shard=shard)
        return [(digest, size_bytes)] if victims is None else victims

    def confirm(self, digest: bytes) -> bool:
        """A worker stored ``digest`` here: ready now. False for a store the directory did not plan (or has
        evicted since): it is not taken in, and the caller has the worker remove it."""
        where = self._where.get(digest)
        if where is None:
            return False
        self._budgets[where].confirm(digest)
        return True

    def evicted_before_confirm(self, digest: bytes) -> bool:
        """Whether ``digest`` was evicted while its store was pending (and forget that it was): its confirmation
        crossed the eviction, which the worker has been sent already."""
        return self._evicted_pending.take(digest)

    def drop(self, digest: bytes) -> bool:
        """The entry is gone (evicted by instruction, a failed store, a fault); True if it was here."""
        where = self._where.pop(digest, None)
        if where is None:
            return False
        self._budgets[where].forget(digest)
        return True

    def ready_bytes(self, rank: int, shard: int) -> int:
        """Bytes of the confirmed entries of one budget (what its medium has written)."""
        budget = self._budgets.get((rank, shard))
        return 0 if budget is None else budget.ready_bytes

    def limit(self, rank: int, shard: int, limit_bytes: int | None) -> list[Victim]:
        """Cap one budget at what its medium has room for now (None: the configured size again); the entries
        evicted, oldest first by the tier's order, to fit under it."""
        budget = self._budget(rank, shard)
        budget.limit_bytes = limit_bytes
        victims = budget.shrink()
        self._taken(budget, victims)
        return victims

    def touch(self, digest: bytes) -> None:
        where = self._where.get(digest)
        if where is not None:
            self._budgets[where].policy.on_access(digest)

    def pin(self, digests: Iterable[bytes]) -> None:
        self._pinned.update(digests)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def lease(self, digest: bytes) -> bool:
        """Pin a ready entry until ``end_lease`` (across steps); False when it is not held."""
        if not self.holds(digest):
            return False
        self._leased[digest] = self._leased.get(digest, 0) + 1
        return True

    def end_lease(self, digest: bytes) -> None:
        count = self._leased.get(digest, 0) - 1
        if count > 0:
            self._leased[digest] = count
        else:
            self._leased.pop(digest, None)

    def retain_for_session(self, session: str, digests: Sequence[bytes]) -> None:
        """Evict ``digests`` last while ``session`` is open (held now or stored later; a tier with a share)."""
        if self.spec.retention_share <= 0:
            return
        self._sessions.setdefault(session, []).extend(digests)
        for policy in self._retaining.values():  # every rank's budget: a digest is only ever present on its own
            policy.retain(session, digests)

    def end_session(self, session: str) -> None:
        self._sessions.pop(session, None)
        for policy in self._retaining.values():
            policy.release(session)

    def protected_bytes(self) -> int:
        return sum(policy.protected_bytes for policy in self._retaining.values())

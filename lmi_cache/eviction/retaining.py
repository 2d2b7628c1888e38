"""Session retention: open sessions' chunks are evicted last, within a byte cap (torch-free, worker process).

While a stateful session is open, the chunks of its conversation are worth
more than others: its next round re-sends the whole conversation, and a
missing prefix chunk makes every later chunk useless (lookups stop at the
first miss). Under pressure plain LRU evicts them anyway, because many
sessions cycling through a tier smaller than their working set is LRU's worst
case (every round evicts the chunks that the next round needs). So:

* ``RetentionBook`` (pure bookkeeping) says which digests each open session
  retains; a digest shared by several sessions (a common system prompt) is
  retained until the last of them is released.
* ``RetainingPolicy`` wraps the tier's policy. A chunk that is retained and
  present is *protected*: it leaves the inner policy and joins a protected
  list, which ``candidates()`` yields only after every unprotected key. So a
  protected chunk is never evicted before a chunk of no open session, while
  the tier still never refuses a store that plain eviction would admit.
* Protected bytes never exceed ``cap_bytes`` (share x tier capacity). A
  chunk that would cross the cap stays an ordinary key (retained, not
  protected) until room appears and it is retained again or read. First come
  keeps its protection until its session is released: rotating protection to
  the newest session would be LRU again, with the same thrashing.
* Released chunks rejoin the inner policy as newly inserted (the generic
  policy interface has no "insert as oldest").

Sizes come from ``size_of(digest)`` (None: not in the tier). Like every
policy method, ``retain`` and ``release`` must be called under the tier's
lock (``CpuTier`` does so), and ``size_of`` must not take that lock.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from itertools import chain

from lmi_cache.errors import ConfigError
from lmi_cache.eviction.base import EvictionPolicy

SizeOf = Callable[[Hashable], "int | None"]

# extra_config.session_retention_share when not set (the planner writes it too): half the CPU tier
# for open sessions leaves the other half to LRU for everything else.
DEFAULT_RETENTION_SHARE = 0.5


def parse_retention_share(value: object, where: str) -> float:
    """``extra_config.session_retention_share``: a number from 0 (off) to 1 (the whole CPU tier)."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and len(value) <= 40:
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not 0.0 <= number <= 1.0:  # NaN fails the comparison too
        raise ConfigError(f"{where}: expected a share of the CPU tier from 0 (off) to 1, e.g. 0.5; got {value!r:.60}")
    return number


class RetentionBook:
    """Which digests each open session retains, with per-digest reference counts."""

    def __init__(self) -> None:
        self._by_session: dict[str, set[Hashable]] = {}
        self._refs: dict[Hashable, int] = {}

    def retain(self, session: str, digests: Iterable[Hashable]) -> list[Hashable]:
        """Add ``digests`` to ``session``; returns those no session retained before."""
        held = self._by_session.setdefault(session, set())
        fresh: list[Hashable] = []
        for digest in digests:
            if digest in held:
                continue
            held.add(digest)
            count = self._refs.get(digest, 0)
            self._refs[digest] = count + 1
            if count == 0:
                fresh.append(digest)
        return fresh

    def release(self, session: str) -> list[Hashable]:
        """Forget ``session``; returns the digests that no session retains any more."""
        freed: list[Hashable] = []
        for digest in self._by_session.pop(session, ()):
            count = self._refs[digest] - 1
            if count:
                self._refs[digest] = count
            else:
                del self._refs[digest]
                freed.append(digest)
        return freed

    def is_retained(self, digest: Hashable) -> bool:
        return digest in self._refs

    def has_session(self, session: str) -> bool:
        return session in self._by_session

    def sessions(self) -> list[str]:
        return list(self._by_session)

    def digests_of(self, session: str) -> frozenset[Hashable]:
        return frozenset(self._by_session.get(session, ()))

    @property
    def num_retained(self) -> int:
        return len(self._refs)


class RetainingPolicy(EvictionPolicy):
    """An eviction order that puts protected (retained, within the cap) keys last; see the module docstring."""

    def __init__(self, inner: EvictionPolicy, cap_bytes: int, size_of: SizeOf) -> None:
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, got {cap_bytes}")
        self._inner = inner
        self._cap_bytes = cap_bytes
        self._size_of = size_of
        self.book = RetentionBook()
        self._protected: OrderedDict[Hashable, int] = OrderedDict()  # key -> bytes, least recently used first
        self._protected_bytes = 0
        self.num_released_sessions = 0

    # ------------------------------------------------------------ retention
    @property
    def cap_bytes(self) -> int:
        return self._cap_bytes

    @property
    def protected_bytes(self) -> int:
        return self._protected_bytes

    def is_protected(self, key: Hashable) -> bool:
        return key in self._protected

    def retain(self, session: str, digests: Iterable[Hashable]) -> None:
        """Retain ``digests`` (present or stored later) while ``session`` is open.

        Digests are taken in order and protection stops at the first one that
        would cross the cap: a prompt's leading chunks are the ones worth
        keeping, since a lookup stops at its first miss.
        """
        ordered = list(digests)
        self.book.retain(session, ordered)
        for digest in ordered:
            if digest not in self._protected and not self._try_protect(digest):
                break

    def release(self, session: str) -> None:
        """``session`` closed or expired: its chunks become ordinary keys (shared ones stay retained)."""
        if not self.book.has_session(session):
            return
        self.num_released_sessions += 1
        for digest in self.book.release(session):
            size = self._protected.pop(digest, None)
            if size is not None:
                self._protected_bytes -= size
                self._inner.on_insert(digest)

    def _try_protect(self, key: Hashable) -> bool:
        """Move a present, retained key into the protected list if the cap allows; True if it is protected."""
        if not self.book.is_retained(key):
            return False
        size = self._size_of(key)
        if size is None:
            return True  # not stored yet: protected on insert, nothing to decide now
        if self._protected_bytes + size > self._cap_bytes:
            return False
        self._inner.on_remove(key)
        self._protected[key] = size
        self._protected_bytes += size
        return True

    # ------------------------------------------------------------ EvictionPolicy
    def on_insert(self, key: Hashable) -> None:
        self._touch(key, self._inner.on_insert)

    def on_access(self, key: Hashable) -> None:
        self._touch(key, self._inner.on_access)

    def _touch(self, key: Hashable, inner: Callable[[Hashable], None]) -> None:
        """A protected key moves up its own list; any other goes to the inner policy and may become protected."""
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        inner(key)
        self._try_protect(key)

    def on_remove(self, key: Hashable) -> None:
        size = self._protected.pop(key, None)
        if size is None:
            self._inner.on_remove(key)
        else:
            self._protected_bytes -= size

    def candidates(self) -> Iterator[Hashable]:
        return chain(self._inner.candidates(), iter(self._protected))

    def __len__(self) -> int:
        return len(self._inner) + len(self._protected)

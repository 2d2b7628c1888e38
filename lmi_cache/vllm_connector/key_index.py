"""The scheduler's view of which chunks the workers' engines hold (scheduler process).

The scheduler cannot see the workers' memory, so it mirrors their contents as
a set of digests fed by the events workers report each step (and, at start-up,
by the digests already persisted on the disk tier). Digests are namespaced by
rank, so one set serves every rank: a chunk is a hit only when every rank's
digest for it is present. The index may be stale (a worker evicted a chunk in
between); the worker then reports a load error and vLLM recomputes, so a stale
entry costs time, never correctness.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from lmi_cache.keys.hashing import ChunkKey

# Saves issued but not yet confirmed are remembered this many steps, so that
# concurrent requests sharing a prefix do not save the same chunk twice.
PENDING_SAVE_STEPS = 64


class KeyIndex:
    """Set of digests held by the workers, plus recently issued saves."""

    def __init__(self, seed_digests: Iterable[bytes] = ()) -> None:
        self._digests: set[bytes] = set(seed_digests)
        self._pending_saves: dict[bytes, int] = {}
        self._step = 0

    def __len__(self) -> int:
        return len(self._digests)

    def __contains__(self, digest: object) -> bool:
        return digest in self._digests

    def add(self, digests: Iterable[bytes]) -> None:
        for digest in digests:
            self._digests.add(digest)
            self._pending_saves.pop(digest, None)

    def discard(self, digests: Iterable[bytes]) -> None:
        for digest in digests:
            self._digests.discard(digest)
            self._pending_saves.pop(digest, None)

    def has_all(self, keys: Sequence[ChunkKey]) -> bool:
        """True when every rank holds its key of this chunk."""
        return all(key.digest in self._digests for key in keys)

    def leading_hits(self, chunk_keys: Sequence[Sequence[ChunkKey]]) -> int:
        """How many leading chunks are held by every rank."""
        count = 0
        for keys in chunk_keys:
            if not self.has_all(keys):
                break
            count += 1
        return count

    def save_pending(self, keys: Sequence[ChunkKey]) -> bool:
        return all(key.digest in self._pending_saves for key in keys)

    def mark_save_pending(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            self._pending_saves[key.digest] = self._step

    def next_step(self) -> None:
        """Forget pending saves whose confirmation never came (store refused, worker fault)."""
        self._step += 1
        horizon = self._step - PENDING_SAVE_STEPS
        if self._pending_saves and min(self._pending_saves.values()) < horizon:
            self._pending_saves = {d: s for d, s in self._pending_saves.items() if s >= horizon}

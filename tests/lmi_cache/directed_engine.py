"""An engine driven by a placement directory the way the vLLM connector drives them (one rank, no vLLM).

The engine has no policy of its own: every put names its tiers and every read
its source, and what leaves a tier is the directory's eviction. Tests that
want realistic traffic through real CPU and disk tiers (budgets, evictions,
demotion, promotion) say it with ``Directed``: each call is one scheduler step
(plan, apply this rank's evictions, move the bytes, report back), in the
order the connector's worker side follows.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.engine import CacheEngine
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.placement.messages import REMOTE, TierEvent
from lmi_cache.placement.startup import build_directory


class Directed:
    """A ``CacheEngine`` and the ``PlacementDirectory`` that decides for it (rank 0, KV cache group 0)."""

    def __init__(self, config: CacheConfig, payload_bytes: int, metrics: CacheMetrics | None = None) -> None:
        self.directory: PlacementDirectory = build_directory(config, replica=0, world_size=1)
        self.engine = CacheEngine(config, metrics=metrics)
        self.directory.sizes.set_chunk_bytes(0, 0, payload_bytes)
        self._instructed: list[TierEvent] = []

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Directed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _apply_evictions(self) -> None:
        for eviction in self.directory.take_evictions().get(0, ()):
            self.engine.evict(eviction.tier, eviction.digest, eviction.demote_to)
            if eviction.demote_to:
                self._instructed.append(TierEvent(eviction.demote_to, eviction.digest))

    def _report(self) -> None:
        stored, dropped = self.engine.drain_events()
        landed = {(e.tier, e.digest) for e in stored}
        failed = [e for e in self._instructed if e.tier != REMOTE and (e.tier, e.digest) not in landed]
        self._instructed = []
        self.directory.complete(0, stored, failed, dropped)
        self.directory.end_step()

    def save(self, key: ChunkKey, data: torch.Tensor) -> tuple[str, ...]:
        """One step storing ``data`` where the directory plans it; the tiers it planned."""
        tiers = self.directory.prepare_store([key], 0)
        self._apply_evictions()
        self._instructed.extend(TierEvent(tier, key.digest) for tier in tiers)
        if tiers:
            self.engine.save_many([key], tuple(data.shape), data.dtype, lambda outs: outs[0].copy_(data), [tiers])
        self._report()
        return tiers

    def load(self, key: ChunkKey) -> torch.Tensor | None:
        """One step loading ``key`` from where the directory says it is (promoted when it says so); None: a miss."""
        source = self.directory.lookup([key])
        got: torch.Tensor | None = None
        if source is not None:
            placed = self.directory.prepare_load([key], 0, source)
            self._apply_evictions()
            if placed.promote:
                self._instructed.append(TierEvent(self.directory.first_tier_name, key.digest))
            for batch in self.engine.load([key], [source], [placed.promote]):
                for _, obj in batch:
                    got = obj.payload_tensor().clone()
                    obj.release()
        self._report()
        return got

    def step(self) -> None:
        """A step with no loads or saves: pending evictions applied, reports handed back."""
        self._apply_evictions()
        self._report()

    def held(self, tier: str) -> set[bytes]:
        """What the engine's ``tier`` holds now."""
        return set(next(t for t in self.engine.tiers if t.name == tier).digests())

    def planned(self, tier: str) -> set[bytes]:
        """What the directory says ``tier`` holds (ready) now."""
        book = next(b for b in self.directory.books if b.name == tier)
        return {d for d in book.digests() if book.holds(d)}

    def sources(self, keys: Sequence[ChunkKey]) -> list[str | None]:
        return [self.directory.lookup([key]) for key in keys]

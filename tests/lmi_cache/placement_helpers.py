"""Placement directories and worker reports for scheduler-side tests (no vLLM)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lmi_cache.placement.book import TierSpec
from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.placement.messages import TierEvent
from lmi_cache.vllm_connector.metadata import LmiWorkerMeta


def directory(chunk_tokens: int = 32, cpu_bytes: int = 1 << 40, remote: Any = None) -> PlacementDirectory:
    """A CPU tier that never fills (entries take their payload bytes; none reported: 0), optionally a remote store."""
    return PlacementDirectory([TierSpec("cpu", cpu_bytes, lambda n: n)], chunk_tokens=chunk_tokens, remote=remote,
                              remote_writes=remote is not None)


def _events(digests: Mapping[int, Iterable[bytes]], tier: str) -> dict[int, list[TierEvent]]:
    return {rank: [TierEvent(tier, d) for d in ds] for rank, ds in digests.items()}


def stored(digests: Mapping[int, Iterable[bytes]], tier: str = "cpu", **fields: Any) -> LmiWorkerMeta:
    """A worker report: these digests (per rank) landed in ``tier``."""
    return LmiWorkerMeta(stored=_events(digests, tier), **fields)


def dropped(digests: Mapping[int, Iterable[bytes]], tier: str = "cpu", **fields: Any) -> LmiWorkerMeta:
    """A worker report: ``tier`` lost these digests (per rank) on its own."""
    return LmiWorkerMeta(dropped=_events(digests, tier), **fields)


def confirm_stored(directory: PlacementDirectory, per_rank_keys: Iterable[Iterable[Any]], tier: str = "cpu") -> None:
    """The directory plans these chunks (each an iterable of per-rank keys) into ``tier`` and the workers confirm
    storing them (a store it never planned would be refused)."""
    for keys in per_rank_keys:
        keys = list(keys)
        directory.prepare_receive(keys, 0, tier)
        for rank, key in enumerate(keys):
            directory.complete(rank, stored=[TierEvent(tier, key.digest)])

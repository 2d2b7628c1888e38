"""Small dataclasses that cross the scheduler <-> worker boundary of the connector.

Scheduler -> workers: ``LmiConnectorMetadata`` (built once per step in the
scheduler process, bound on every worker): the placement directory's
evictions (by rank: each worker applies its own), then which chunks to load into which block ids (from which tier)
before the forward pass, and which full chunks to save (into which tiers)
after it. Workers -> scheduler: ``LmiWorkerMeta`` (built per step on each
worker, aggregated across ranks by vLLM): per rank, the stores that landed or
failed and the entries its media lost (``placement.messages.TierEvent``), and
the KV layout tag and chunk sizes it recognised (sent until the scheduler's
metadata says it has every rank's: ``layout_known``). Everything here is
plain data so it pickles across vLLM's process boundaries; no tensors, and no
vLLM import: vLLM only duck-types these objects (it binds the metadata on the
workers and calls ``aggregate`` on the workers' metadata), so its abstract
base classes are not needed and this module imports in milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.placement.messages import Eviction, TierEvent


@dataclass(frozen=True)
class ChunkTransfer:
    """One chunk to move for one request.

    ``keys[r]`` is the chunk key in rank ``r``'s namespace (rank = pp_rank *
    tp_size + tp_rank). ``block_ids[i]`` receives (load) or provides (save)
    block ``block_offset + i`` of the chunk; a save always covers the whole
    chunk, a load may cover a tail of it (vLLM's prefix cache holds the head)
    or a head of it (at least one prompt token is left to compute), or, for a
    sliding-window group, a tail of the first chunk its window touches.
    ``group`` is the vLLM KV cache group (``lmi_cache.keys.kv_groups``) whose
    layers and block table the chunk belongs to.
    """

    req_id: str
    keys: tuple[ChunkKey, ...]  # one per rank
    block_ids: tuple[int, ...]
    block_offset: int = 0
    group: int = 0
    source: str = ""  # a load: the tier the placement directory says holds it ("peer@H:P": the peer a
    # request's router named, read through the peer tier)
    promote_to: str = ""  # a load: also put it into this tier (the first one; "": no)
    tiers: tuple[str, ...] = ()  # a save: the tiers to store it into


@dataclass
class LmiConnectorMetadata:
    """What every worker must do this step."""

    evictions: dict[int, list[Eviction]] = field(default_factory=dict)  # rank -> its evictions, before the loads
    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    # Requests whose loads above vLLM waits for between steps (sliding-window or multi-group models): each worker
    # reports them finished, or failed (vLLM then recomputes the request), once its loads are done.
    async_loads: list[str] = field(default_factory=list)
    # The scheduler has every rank's layout tag and chunk sizes: the workers stop sending them.
    layout_known: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves and not self.evictions and not self.async_loads


def _merged(*parts: dict[int, list[TierEvent]]) -> dict[int, list[TierEvent]]:
    merged: dict[int, list[TierEvent]] = {}
    for part in parts:
        for rank, events in part.items():
            merged.setdefault(rank, []).extend(events)
    return merged


@dataclass
class LmiWorkerMeta:
    """What the workers did this step, keyed by rank index (see the module docstring)."""

    layout_tags: dict[int, str] = field(default_factory=dict)
    chunk_bytes: dict[int, dict[int, int]] = field(default_factory=dict)  # rank -> KV cache group -> payload bytes
    stored: dict[int, list[TierEvent]] = field(default_factory=dict)
    failed: dict[int, list[TierEvent]] = field(default_factory=dict)
    dropped: dict[int, list[TierEvent]] = field(default_factory=dict)

    def aggregate(self, other: object) -> LmiWorkerMeta:
        if not isinstance(other, LmiWorkerMeta):
            return self
        return LmiWorkerMeta(
            layout_tags={**self.layout_tags, **other.layout_tags},
            chunk_bytes={**self.chunk_bytes, **other.chunk_bytes},
            stored=_merged(self.stored, other.stored),
            failed=_merged(self.failed, other.failed),
            dropped=_merged(self.dropped, other.dropped),
        )

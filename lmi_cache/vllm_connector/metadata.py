"""Small dataclasses that cross the scheduler <-> worker boundary of the connector.

Scheduler -> workers: ``LmiConnectorMetadata`` (built once per step in the
scheduler process, bound on every worker): which chunks to load into which
block ids before the forward pass, and which full chunks to save after it.
Workers -> scheduler: ``LmiWorkerMeta`` (built per step on each worker,
aggregated across ranks by vLLM): the digests each rank's engine stored or
dropped, the KV layout tag it recognised, and load faults. Everything here is
plain data so it pickles across vLLM's process boundaries; no tensors, and no
vLLM import: vLLM only duck-types these objects (it binds the metadata on the
workers and calls ``aggregate`` on the workers' metadata), so its abstract
base classes are not needed and this module imports in milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lmi_cache.keys.hashing import ChunkKey


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


@dataclass
class LmiConnectorMetadata:
    """What every worker must do this step."""

    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    # Session retention (lmi_cache.eviction.session_tracker), applied before the saves: release these
    # sessions, then retain, per session, new prompt chunks (digests per rank).
    release: list[str] = field(default_factory=list)
    retain: dict[str, list[tuple[bytes, ...]]] = field(default_factory=dict)
    # Requests whose loads above vLLM waits for between steps (sliding-window or multi-group models): each worker
    # reports them finished, or failed (vLLM then recomputes the request), once its loads are done.
    async_loads: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves and not self.release and not self.retain and not self.async_loads


@dataclass
class LmiWorkerMeta:
    """What the workers' engines changed this step, keyed by rank index."""

    layout_tags: dict[int, str] = field(default_factory=dict)
    stored_digests: dict[int, list[bytes]] = field(default_factory=dict)
    removed_digests: dict[int, list[bytes]] = field(default_factory=dict)
    num_load_faults: int = 0

    def aggregate(self, other: object) -> LmiWorkerMeta:
        if not isinstance(other, LmiWorkerMeta):
            return self
        merged = LmiWorkerMeta(
            layout_tags={**self.layout_tags, **other.layout_tags},
            stored_digests={r: list(v) for r, v in self.stored_digests.items()},
            removed_digests={r: list(v) for r, v in self.removed_digests.items()},
            num_load_faults=self.num_load_faults + other.num_load_faults,
        )
        for rank, digests in other.stored_digests.items():
            merged.stored_digests.setdefault(rank, []).extend(digests)
        for rank, digests in other.removed_digests.items():
            merged.removed_digests.setdefault(rank, []).extend(digests)
        return merged

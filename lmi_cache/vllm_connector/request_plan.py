"""One request's plan and the chunk transfers of one scheduler step (vLLM scheduler process, no tensors).

``SchedulerGeometry`` is what the scheduler knows of the deployment (block
and chunk size, ranks, vLLM's KV cache groups). ``RequestPlan`` is what it
keeps per request: chunk keys per group and rank, block ids per group, how
far the request's chunks are loaded or saved, its confirmed load and its
remote and peer lookups (a chunk held locally loads from there, else from
the peer its router named when that peer holds it, else from the remote
store). ``plan_step`` turns a scheduled request into this step's
loads (each from the tier the placement directory names) and saves (into the
tiers it reserves room in).

A sliding-window group loads only the blocks vLLM allocates for it (from the
window's start before the hit) and never saves a chunk vLLM has freed blocks
of; a request for which vLLM gave some group no blocks loads nothing (its
asynchronous load is then answered failed, and vLLM recomputes it).

With speculative decoding by an EAGLE-family drafter (EAGLE, EAGLE-3, MTP), the
drafter's attention layers sit in the target's KV cache group, so every chunk
holds their KV too and a load fills them with the target's. The drafter's KV
at a prompt's last computed token was made with the token after it (the next
prompt token, or the sampled one at the prompt's end), which a request sharing
only the prefix need not have: like vLLM's own prefix cache
(``drop_eagle_block``), a hit then backs off one block
(``SchedulerGeometry.drafter_backoff_tokens``), so that token is recomputed and
the drafter rewrites its KV. Multi-module MTP re-prefills the last
``num_speculative_tokens - 1`` tokens of a step (vLLM's
``num_reprefillable_tokens``): a chunk is saved only once those are past it
(``unfinal_tail_tokens``). Saves never reach past the prompt: the lookahead
slots vLLM allocates for draft tokens and the draft tokens themselves are
never stored.

A state group (Mamba layers) loads one transfer: the state at the hit, into
the block vLLM allocates for it (index ``hit // block - 1`` of its table). It
saves only the boundary states vLLM offers in this step
(``plan_state_saves``), each from exactly the block vLLM names, never one
worked out from the block table.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.keys.kv_groups import NULL_BLOCK_ID, STATE, KvCacheGroup, is_single_full_group, longest_hit_tokens
from lmi_cache.peer.hint import PEER, PeerAddress, peer_source
from lmi_cache.placement.directory import REMOTE, Describe, PlacementDirectory
from lmi_cache.placement.events import ChunkBlocks
from lmi_cache.vllm_connector.metadata import ChunkTransfer, LmiConnectorMetadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerGeometry:
    block_size_tokens: int
    chunk_size_tokens: int
    world_size: int  # tp_size * pp_size: one namespace per rank
    min_retrieve_tokens: int = 0
    # vLLM's KV cache groups; the default is one full-attention group (the hybrid manager off).
    groups: tuple[KvCacheGroup, ...] = (KvCacheGroup(0, ()),)
    # An EAGLE-family drafter (vLLM's use_eagle_block_drop): a hit backs off this much (one block), see above.
    drafter_backoff_tokens: int = 0
    # Multi-module MTP: the last tokens of a step whose drafter KV the next step rewrites (not saved yet).
    unfinal_tail_tokens: int = 0

    @property
    def loads_async(self) -> bool:
        """Load between steps unless the model is one full-attention group.

        vLLM 0.32 stops on failed block ids from a model with several groups, and recomputes a sliding-window
        group from the first failed block although the blocks before it are null: only a request waiting
        for its KV (``failed_recving``) is recomputed safely, from its first token.
        """
        return not is_single_full_group(self.groups)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size_tokens // self.block_size_tokens


def usable_hit_tokens(geo: SchedulerGeometry, num_chunks: int, max_tokens: int,
                      held: Callable[[int, int], bool]) -> int:
    """The longest prefix a load can restore (``kv_groups.longest_hit_tokens``), backed off for a drafter, and 0
    below ``min_retrieve_tokens``. ``max_tokens``: the cap (vLLM computes at least one prompt token)."""
    def longest(cap: int) -> int:
        return longest_hit_tokens(geo.groups, num_chunks, geo.chunk_size_tokens, geo.block_size_tokens, cap, held)

    hit = longest(max_tokens)
    if hit > 0 and geo.drafter_backoff_tokens:
        hit = longest(hit - geo.drafter_backoff_tokens)
    return hit if hit >= geo.min_retrieve_tokens else 0


@dataclass
class ExistenceCheck:
    """A request's asynchronous question to a store the directory does not mirror (the remote store, a peer)."""

    from_chunk: int = -1  # first chunk the question covers (-1: not asked yet)
    pending: Any = None  # the in-flight question (``poll()`` answers), None once answered
    found: set[tuple[int, int]] | None = None  # (group, chunk) from from_chunk present on every rank
    answered_by: PeerAddress | None = None  # the peer that answered (one the shared store's holder records named)


@dataclass
class RequestPlan:
    chunk_keys: Sequence[Sequence[tuple[ChunkKey, ...]]]  # per KV cache group, per full prompt chunk, per rank
    num_prompt_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    num_done_chunks: int = 0  # chunks below this were loaded, saved or found cached
    load_range: tuple[int, int] | None = None  # tokens [start, end) to load
    load_confirmed: bool = False
    remote: ExistenceCheck = field(default_factory=ExistenceCheck)  # in the remote store
    # The peer the request's router names (kv_transfer_params), else the one the shared store named as holding
    # its leading chunks (``peer.holders``), if any.
    peer: PeerAddress | None = None
    peer_check: ExistenceCheck = field(default_factory=ExistenceCheck)  # at that peer
    # The load spec the last lookup found: (group, chunk) -> the tier holding it on every rank ("remote" and
    # "peer" too), so planning the load asks the directory nothing again (vLLM's kv_offload keeps its load spec
    # the same way).
    sources: dict[tuple[int, int], str] = field(default_factory=dict)
    session_id: str | None = None  # vLLM's request.session_id (the front forwards LMI's session)
    saves_allowed: bool = True  # False once the request was blended: none of its chunks is exact KV to store
    # (group, chunk) -> what the chunk's KV events say (vLLM's block hashes and tokens); None: no events
    describe: Callable[[int, int], ChunkBlocks | None] | None = None

    def describer(self, group: int, chunk: int) -> Describe | None:
        describe = self.describe
        return None if describe is None else (lambda: describe(group, chunk))


def plan_step(geo: SchedulerGeometry, directory: PlacementDirectory, req_id: str, plan: RequestPlan,
              num_computed_tokens: int, num_scheduled_tokens: int, meta: LmiConnectorMetadata) -> int:
    """Add one scheduled request's loads and saves of this step to ``meta``; how many saves were planned."""
    chunk = geo.chunk_size_tokens
    if plan.load_confirmed and plan.load_range is not None:
        start, end = plan.load_range
        _plan_loads(geo, directory, req_id, plan, start, end, meta)
        # Loaded chunks (even a partially loaded last one) are already in the store.
        plan.num_done_chunks = max(plan.num_done_chunks, -(-end // chunk))
    plan.load_range, plan.load_confirmed = None, False
    if not plan.saves_allowed:
        return 0
    # Prompt tokens only (not the draft tokens or lookahead slots of a decode step), final ones only.
    computed_after = min(num_computed_tokens + num_scheduled_tokens - geo.unfinal_tail_tokens, plan.num_prompt_tokens)
    ready_chunks = min(computed_after // chunk, len(plan.chunk_keys[0]))
    planned = 0
    for c in range(plan.num_done_chunks, ready_chunks):
        for group in geo.groups:
            if group.kind == STATE:
                continue  # saved from vLLM's boundary-state offers (plan_state_saves)
            planned += _plan_group_save(geo, directory, req_id, plan, group, c, num_computed_tokens, meta)
    plan.num_done_chunks = max(plan.num_done_chunks, ready_chunks)
    return planned


LoadPart = tuple[tuple[ChunkKey, ...], tuple[int, ...], int, int]  # one chunk's keys, block ids, block offset, index


def _plan_loads(geo: SchedulerGeometry, directory: PlacementDirectory, req_id: str, plan: RequestPlan,
                start: int, end: int, meta: LmiConnectorMetadata) -> None:
    """Every group's loads of tokens [start, end), or none: a request loaded in part would resume on blocks
    (or a state) nobody wrote. With no load planned, the workers answer an asynchronous load failed and vLLM
    recomputes the request."""
    parts = {group.index: _group_load_parts(geo, plan, group, start, end) for group in geo.groups}
    missing = [g for g, p in parts.items() if p is None]
    if missing:
        logger.warning("lmi-cache: request %s has no blocks for its load of group(s) %s; not loading it",
                       req_id, missing)
        return
    sources: dict[int, str] = {}  # chunk -> the tier it loads from
    for group, group_parts in parts.items():
        for keys, ids, offset, c in group_parts or ():
            source = plan.sources.get((group, c)) or directory.lookup(keys) or _unmirrored_source(plan, group, c)
            sources[c] = source
            placed = directory.prepare_load(keys, group, source, plan.describer(group, c))
            where = peer_source(plan.peer) if source == PEER and plan.peer is not None else placed.tier
            meta.loads.append(ChunkTransfer(req_id, keys, ids, offset, group, source=where,
                                            promote_to=directory.first_tier_name if placed.promote else ""))
    chunk = geo.chunk_size_tokens
    for c, source in sources.items():  # each prompt token once, whatever the number of groups
        directory.metrics.tier_hit(source, min(end, (c + 1) * chunk) - max(start, c * chunk))


def _unmirrored_source(plan: RequestPlan, group: int, chunk: int) -> str:
    """A chunk no local tier holds loads from the request's peer when it holds it (one hop, no second copy),
    else from the remote store."""
    return PEER if plan.peer is not None and (group, chunk) in (plan.peer_check.found or ()) else REMOTE


def _group_load_parts(geo: SchedulerGeometry, plan: RequestPlan, group: KvCacheGroup, start: int,
                      end: int) -> list[LoadPart] | None:
    """One group's chunks to load for tokens [start, end) (None: vLLM gave it no blocks for them).

    A sliding-window group loads from its window's first block; a state group loads the one state at ``end``
    (a chunk boundary) into the block vLLM allocated for it.
    """
    chunk, block, per_chunk = geo.chunk_size_tokens, geo.block_size_tokens, geo.blocks_per_chunk
    block_ids = plan.block_ids[group.index]
    if group.kind == STATE:
        position = end // block - 1
        if end % chunk or position >= len(block_ids) or block_ids[position] == NULL_BLOCK_ID:
            return None
        c = end // chunk - 1
        return [(plan.chunk_keys[group.index][c], (block_ids[position],), 0, c)]
    start = max(start, group.first_needed_block(end, block) * block)
    parts: list[LoadPart] = []
    for c in range(start // chunk, -(-end // chunk)):
        first_block = max(start, c * chunk) // block
        end_block = min(end, (c + 1) * chunk) // block
        ids = block_ids[first_block:end_block]
        if len(ids) != end_block - first_block or (group.is_sliding and NULL_BLOCK_ID in ids):
            return None
        parts.append((plan.chunk_keys[group.index][c], tuple(ids), first_block - c * per_chunk, c))
    return parts


def plan_state_saves(geo: SchedulerGeometry, directory: PlacementDirectory, req_id: str, plan: RequestPlan,
                     offers: Sequence[tuple[int, int, int]], meta: LmiConnectorMetadata) -> int:
    """Saves of the boundary states vLLM offers this step (``(group, block_id, boundary_tokens)``) that end a
    prompt chunk; each from exactly the offered block, gathered by the workers in this same step."""
    if not plan.saves_allowed:
        return 0
    state_groups = {g.index for g in geo.groups if g.kind == STATE}
    chunk = geo.chunk_size_tokens
    planned = 0
    for group, block_id, boundary in offers:
        c = boundary // chunk - 1
        if (group not in state_groups or block_id == NULL_BLOCK_ID or boundary <= 0 or boundary % chunk
                or c >= len(plan.chunk_keys[group])):
            continue
        keys = plan.chunk_keys[group][c]
        tiers = directory.prepare_store(keys, group, describe=plan.describer(group, c))
        if tiers:
            meta.saves.append(ChunkTransfer(req_id, keys, (block_id,), 0, group, tiers=tiers))
            planned += 1
    return planned


def _plan_group_save(geo: SchedulerGeometry, directory: PlacementDirectory, req_id: str, plan: RequestPlan,
                     group: KvCacheGroup, c: int, num_computed_tokens: int, meta: LmiConnectorMetadata) -> int:
    """Save chunk ``c`` of one group, unless stored, or vLLM no longer keeps all of its blocks."""
    per_chunk = geo.blocks_per_chunk
    keys = plan.chunk_keys[group.index][c]
    # vLLM freed a sliding-window group's blocks before its window when this step started: their ids
    # may already hold another request's KV.
    if group.first_needed_block(num_computed_tokens, geo.block_size_tokens) > c * per_chunk:
        return 0
    ids = plan.block_ids[group.index][c * per_chunk : (c + 1) * per_chunk]
    if len(ids) != per_chunk or (group.is_sliding and NULL_BLOCK_ID in ids):
        return 0
    tiers = directory.prepare_store(keys, group.index, describe=plan.describer(group.index, c))
    if not tiers:
        return 0  # held or being stored already, or no room that this step does not use
    meta.saves.append(ChunkTransfer(req_id, keys, tuple(ids), 0, group.index, tiers=tiers))
    return 1


def count_miss(geo: SchedulerGeometry, directory: PlacementDirectory, plan: RequestPlan, num_tokens: int,
               served_tokens: int) -> None:
    """Count the prompt tokens the caches could have served beyond ``served_tokens`` (whole chunks, up to the
    prompt's length - 1 rounded down to a block) and why they did not: the first missing chunk was stored here
    and evicted (or lost) since, or never stored here. A chunk held yet unused is no cache miss."""
    chunk, block = geo.chunk_size_tokens, geo.block_size_tokens
    useful = min(len(plan.chunk_keys[0]) * chunk, max(num_tokens - 1, 0) // block * block)
    first = served_tokens // chunk
    if useful <= served_tokens or first >= len(plan.chunk_keys[0]):
        return
    keys = [group_keys[first] for group_keys in plan.chunk_keys]
    if all(directory.holds(k) for k in keys):
        return  # held, yet not used (below min_retrieve_tokens, a group's blocks)
    lost = any(directory.was_lost(k) for k in keys)
    directory.metrics.missed("evicted" if lost else "not_stored", useful - served_tokens)

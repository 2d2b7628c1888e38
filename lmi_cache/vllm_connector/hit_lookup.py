"""How many of a request's tokens the caches can supply: the lookup behind ``get_num_new_matched_tokens``
(vLLM scheduler process).

One placement-directory ``lookup`` per chunk for each scheduling decision;
what it finds is kept with the request as its load spec
(``RequestPlan.sources``: chunk -> the tier holding it), so planning the load
asks the directory nothing again. The stores the directory does not mirror
(the remote store; the peer a request's router names, with the peer tier on)
are asked about the chunks beyond the local hit in one batched, asynchronous
existence check each: while one is in flight the answer is "pending" (None:
vLLM asks again next step, the scheduler never waits); each answer is kept for
the request until its local hit changes. A chunk both hold loads from the peer
(one hop, no second copy). Without a hint, and with holder records in the
fleet's shared store (``peer.holders``), the peer is the one the store names;
it is kept as the request's peer once it answered that it holds chunks.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.scheduler_series import SchedulerMetrics
from lmi_cache.peer.hint import PEER
from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.placement.messages import REMOTE
from lmi_cache.vllm_connector.request_plan import ExistenceCheck, RequestPlan, SchedulerGeometry, usable_hit_tokens

if TYPE_CHECKING:
    from lmi_cache.peer.lookup import PeerLookups


def find_hit_tokens(geo: SchedulerGeometry, directory: PlacementDirectory, metrics: SchedulerMetrics,
                    plan: RequestPlan, num_tokens: int, peers: PeerLookups | None = None) -> int | None:
    """Tokens of the longest prefix the caches hold for every group and rank (leaving one token of the
    ``num_tokens`` to compute), with ``plan.sources`` set; None while a remote or peer check is pending."""
    keys = plan.chunk_keys
    num_chunks = len(keys[0])
    where: dict[tuple[int, int], str | None] = {}

    def held(group: int, chunk: int) -> bool:
        pair = (group, chunk)
        if pair not in where:
            where[pair] = directory.lookup(keys[group][chunk])
        return where[pair] is not None

    remote: set[tuple[int, int]] | None = set()
    peer: set[tuple[int, int]] | None = set()
    hinted = plan.peer if peers is not None else None  # the peer to ask: the router's hint, with the peer tier on
    discover = peers is not None and hinted is None and peers.holders is not None  # else: the store's holder
    if directory.remote is not None or hinted is not None or discover:
        useful_chunks = min(num_chunks, max(num_tokens - 1, 0) // geo.chunk_size_tokens)
        first = min(_leading(held, group, num_chunks) for group in range(len(keys)))
        if directory.remote is not None:
            remote = _unmirrored_hits(geo, metrics, plan, plan.remote, "remote", directory.ask_remote, first,
                                      useful_chunks)
        if peers is not None and hinted is not None:
            peer = _unmirrored_hits(geo, metrics, plan, plan.peer_check, "peer",
                                    functools.partial(peers.ask, hinted), first, useful_chunks)
        elif peers is not None and discover:
            peer = _unmirrored_hits(geo, metrics, plan, plan.peer_check, "peer", peers.discover, first,
                                    useful_chunks)
            if peer:  # loads name this peer (``request_plan``), later checks ask it directly
                plan.peer = plan.peer_check.answered_by
        if remote is None or peer is None:
            return None
    elsewhere = (remote or set()) | (peer or set())
    # vLLM must compute at least one token to produce logits.
    hit_tokens = usable_hit_tokens(geo, num_chunks, num_tokens - 1, lambda g, c: held(g, c) or (g, c) in elsewhere)
    plan.sources = {pair: tier for pair, tier in where.items() if tier is not None}
    for pair in elsewhere - plan.sources.keys():
        plan.sources[pair] = PEER if pair in (peer or ()) else REMOTE
    return hit_tokens


def _leading(held: Callable[[int, int], bool], group: int, num_chunks: int) -> int:
    """How many of ``group``'s leading chunks the local tiers hold on every rank."""
    count = 0
    while count < num_chunks and held(group, count):
        count += 1
    return count


def _unmirrored_hits(geo: SchedulerGeometry, metrics: SchedulerMetrics, plan: RequestPlan, check: ExistenceCheck,
                     kind: str, ask: Callable[[list[ChunkKey]], Any], first: int, end: int) -> set[tuple[int, int]] | None:
    """(group, chunk) pairs of chunks ``first..end`` the store behind ``check`` (the remote store, the request's
    peer) holds for every rank; None while asked."""
    if first >= end:
        return set()
    num_groups = len(plan.chunk_keys)
    if check.from_chunk != first:
        flat = [key for c in range(first, end) for g in range(num_groups) for key in plan.chunk_keys[g][c]]
        check.from_chunk, check.found = first, None
        check.pending = ask(flat)
        metrics.count(f"{kind}_checks")
    if check.found is None:
        found = check.pending.poll()
        if found is None:
            return None
        outcome = getattr(check.pending, "outcome", "answered")
        check.answered_by = getattr(check.pending, "peer", None)
        ranks = geo.world_size
        pairs = [(g, c) for c in range(first, end) for g in range(num_groups)]
        check.found = {pair for i, pair in enumerate(pairs) if all(found[i * ranks : (i + 1) * ranks])}
        check.pending = None
        # Chunks every group holds in one run from ``first`` (what a full-attention hit can use).
        run = first
        while all((g, run) in check.found for g in range(num_groups)):
            run += 1
        metrics.unmirrored_lookup(kind, outcome, run - first)
    return check.found

"""How many of a request's tokens the caches can supply: the lookup behind ``get_num_new_matched_tokens``
(vLLM scheduler process).

One placement-directory ``lookup`` per chunk for each scheduling decision;
what it finds is kept with the request as its load spec
(``RequestPlan.sources``: chunk -> the tier holding it), so planning the load
asks the directory nothing again. With a remote store, the chunks beyond the
local hit are asked of it in one batched, asynchronous existence check: while
it is in flight the answer is "pending" (None: vLLM asks again next step, the
scheduler never waits); its answer is kept for the request until its local hit
changes.
"""
from __future__ import annotations

from collections.abc import Callable

from lmi_cache.metrics.series import SchedulerMetrics
from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.placement.messages import REMOTE
from lmi_cache.vllm_connector.request_plan import RequestPlan, SchedulerGeometry, usable_hit_tokens


def find_hit_tokens(geo: SchedulerGeometry, directory: PlacementDirectory, metrics: SchedulerMetrics,
                    plan: RequestPlan, num_tokens: int) -> int | None:
    """Tokens of the longest prefix the caches hold for every group and rank (leaving one token of the
    ``num_tokens`` to compute), with ``plan.sources`` set; None while the remote check is pending."""
    keys = plan.chunk_keys
    num_chunks = len(keys[0])
    where: dict[tuple[int, int], str | None] = {}

    def held(group: int, chunk: int) -> bool:
        pair = (group, chunk)
        if pair not in where:
            where[pair] = directory.lookup(keys[group][chunk])
        return where[pair] is not None

    remote: set[tuple[int, int]] = set()
    if directory.remote is not None:
        useful_chunks = min(num_chunks, max(num_tokens - 1, 0) // geo.chunk_size_tokens)
        first = min(_leading(held, group, num_chunks) for group in range(len(keys)))
        found = _remote_hits(geo, directory, metrics, plan, first, useful_chunks)
        if found is None:
            return None
        remote = found
    # vLLM must compute at least one token to produce logits.
    hit_tokens = usable_hit_tokens(geo, num_chunks, num_tokens - 1, lambda g, c: held(g, c) or (g, c) in remote)
    plan.sources = {pair: tier for pair, tier in where.items() if tier is not None}
    plan.sources.update({pair: REMOTE for pair in remote if pair not in plan.sources})
    return hit_tokens


def _leading(held: Callable[[int, int], bool], group: int, num_chunks: int) -> int:
    """How many of ``group``'s leading chunks the local tiers hold on every rank."""
    count = 0
    while count < num_chunks and held(group, count):
        count += 1
    return count


def _remote_hits(geo: SchedulerGeometry, directory: PlacementDirectory, metrics: SchedulerMetrics,
                 plan: RequestPlan, first: int, end: int) -> set[tuple[int, int]] | None:
    """(group, chunk) pairs of chunks ``first..end`` the remote store holds for every rank; None while asked."""
    if first >= end:
        return set()
    num_groups = len(plan.chunk_keys)
    if plan.remote_from != first:
        flat = [key for c in range(first, end) for g in range(num_groups) for key in plan.chunk_keys[g][c]]
        plan.remote_from, plan.remote_found = first, None
        plan.remote_pending = directory.ask_remote(flat)
        metrics.count("remote_checks")
    if plan.remote_found is None:
        found = plan.remote_pending.poll()
        if found is None:
            return None
        metrics.remote_lookup(getattr(plan.remote_pending, "outcome", "answered"))
        ranks = geo.world_size
        pairs = [(g, c) for c in range(first, end) for g in range(num_groups)]
        plan.remote_found = {pair for i, pair in enumerate(pairs) if all(found[i * ranks : (i + 1) * ranks])}
        plan.remote_pending = None
        # Chunks every group holds remotely in one run from ``first`` (what a full-attention hit can use).
        run = first
        while all((g, run) in plan.remote_found for g in range(num_groups)):
            run += 1
        metrics.count("remote_hit_chunks", run - first)
    return plan.remote_found

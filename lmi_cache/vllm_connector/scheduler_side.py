"""Scheduler half of LmiCacheConnector: lookups and load/save planning (vLLM scheduler process).

It never touches tensors. What is cached where, and what to evict, is the
placement directory's (``lmi_cache.placement``): this side asks it whether a
chunk is held, plans each load from the tier it names and each save into the
tiers it reserves room in, and hands the workers' reports back to it. Per
request it keeps a plan (``request_plan.RequestPlan``): the prompt's chunk
keys for every rank and KV cache group, hashed once; the lookup's answers
(``hit_lookup``), kept as the load spec; the confirmed load and the
request's blocks. docs/architecture.md ("The scheduler side, hook by hook")
says what each of vLLM's hooks does here and how KV cache groups (sliding
window, Mamba state) are loaded and saved.

Metrics (``SchedulerMetrics``): a lookup is counted once per admission, in
``update_state_after_alloc``, with the answer of the last
``get_num_new_matched_tokens`` for that request; re-asks while the request
waits for memory are not counted. A request admitted without a lookup answer
(cache disabled, or no worker reported its layout in time) counts as a lookup
with no hit, so the hit ratio never flatters a disabled cache.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.keys.key_inputs import KeyRule
from lmi_cache.eviction.session_tracker import SessionTracker
from lmi_cache.metrics.scheduler_series import SchedulerMetrics, SchedulerStats
from lmi_cache.peer.hint import peer_hint
from lmi_cache.peer.holders import ADVERTISED_TIER
from lmi_cache.peer.protocol import PeerIdentity
from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.placement.events import ChunkBlocks
from lmi_cache.vllm_connector.hit_lookup import find_hit_tokens
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata, LmiWorkerMeta
from lmi_cache.vllm_connector.scheduler_views import RequestView, SchedulerOutputView
from lmi_cache.vllm_connector.request_plan import (
    RequestPlan,
    SchedulerGeometry,
    count_miss,
    plan_state_saves,
    plan_step,
)
from lmi_cache.vllm_connector.worker_layouts import KeySpaceFactory, WorkerLayouts

if TYPE_CHECKING:
    from lmi_cache.peer.lookup import PeerLookups

logger = logging.getLogger(__name__)

# (request, group, chunk) -> what that chunk's KV events say (``vllm_connector.kv_events.chunk_blocks``).
ChunkBlocksReader = Callable[[Any, int, int], ChunkBlocks | None]

# How many times a request may be deferred while no worker has reported its layout.
MAX_ASKS_WITHOUT_LAYOUT = 200


class SchedulerSide:
    """Bookkeeping only; see the module docstring for the protocol."""

    def __init__(
        self,
        geometry: SchedulerGeometry,
        key_space: KeySpaceFactory,
        directory: PlacementDirectory,
        metrics: SchedulerMetrics | None = None,
        sessions: SessionTracker | None = None,
        key_rule: KeyRule | None = None,
        chunk_blocks: ChunkBlocksReader | None = None,
        peer_lookups: PeerLookups | None = None,
    ) -> None:
        self.geometry = geometry
        self.key_rule = key_rule if key_rule is not None else KeyRule()
        self._chunk_blocks = chunk_blocks  # None: no KV events (the directory keeps no descriptions)
        self._sessions = sessions  # None: no session retention
        self._peer_lookups = peer_lookups  # None: the peer tier is off (enable_p2p)
        # This server's records in the shared store of what its CPU tier holds, and that tier's book (None: no
        # such records, or no CPU tier to advertise).
        self._advertised = next((book for book in directory.books if book.name == ADVERTISED_TIER), None)
        self._holders = peer_lookups.holders if peer_lookups is not None and self._advertised is not None else None
        # One set of series with the directory's (the connector passes the same object to both).
        self.metrics = metrics if metrics is not None else directory.metrics
        # req id -> hit tokens of its last answered lookup, until admission counts it.
        self._answered: dict[str, int] = {}
        self._gpu_hit: dict[str, int] = {}  # req id -> vLLM's own prefix-cache hit at that lookup
        self.directory = directory
        on_key_space = None if peer_lookups is None else (
            lambda space: peer_lookups.set_identity(PeerIdentity.of(space)))
        self._layouts = WorkerLayouts(geometry, key_space, directory, on_key_space)
        self._asks_without_layout = 0
        self._plans: dict[str, RequestPlan] = {}
        self._async_loads: set[str] = set()  # requests whose load goes out with the next metadata (loads_async)
        self.stats = SchedulerStats(self.metrics)

    # -- lookups -------------------------------------------------------------------------

    def _chunk_keys(self, request: RequestView) -> list[Sequence[tuple[ChunkKey, ...]]]:
        inputs = self.key_rule.inputs(request)
        return [space.for_inputs(inputs).per_chunk for space in self._layouts.group_spaces]

    @property
    def layout_tag(self) -> str | None:
        """The workers' KV layout tag, once the first of them has reported it."""
        return self._layouts.layout_tag

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        if self._layouts.disabled_reason is not None:
            self._answered[req_id] = 0
            return 0, False
        if self._layouts.key_space is None:
            self._asks_without_layout += 1
            if self._asks_without_layout <= MAX_ASKS_WITHOUT_LAYOUT:
                return None, False
            self._answered[req_id] = 0
            return 0, False
        plan = self._plans.get(req_id)
        if plan is None:
            reader = self._chunk_blocks if self.directory.events is not None else None
            plan = RequestPlan(chunk_keys=self._chunk_keys(request), num_prompt_tokens=_num_prompt_tokens(request),
                               session_id=getattr(request, "session_id", None),
                               describe=None if reader is None else functools.partial(reader, request),
                               peer=peer_hint(request) if self._peer_lookups is not None else None)
            self._plans[req_id] = plan
        plan.load_range, plan.load_confirmed = None, False
        self.metrics.count("match_queries")
        geo = self.geometry
        hit_tokens = find_hit_tokens(geo, self.directory, self.metrics, plan, request.num_tokens, self._peer_lookups)
        if hit_tokens is None:
            return None, False  # a remote or peer check is in flight ("pending"): vLLM asks again next step
        self._answered[req_id] = max(hit_tokens, 0)
        self._gpu_hit[req_id] = num_computed_tokens
        num_new = hit_tokens - num_computed_tokens
        if num_new <= 0 or num_new < geo.min_retrieve_tokens:
            return 0, False
        plan.load_range = (num_computed_tokens, hit_tokens)
        return num_new, geo.loads_async

    def update_state_after_alloc(self, request: RequestView, num_external_tokens: int, saves: bool = True,
                                 block_ids: Sequence[Sequence[int]] | None = None) -> None:
        """``num_external_tokens``: what this side loads (the prefix path's share); ``saves``: False for a blended
        request; ``block_ids``: the request's blocks per group, which an asynchronous load is planned into now."""
        hit_tokens = self._answered.pop(request.request_id, None)
        gpu_hit = self._gpu_hit.pop(request.request_id, 0)
        plan = self._plans.get(request.request_id)
        if hit_tokens is not None:
            self.metrics.lookup(_num_prompt_tokens(request), hit_tokens, max(num_external_tokens, 0))
            self.metrics.tier_hit("gpu", gpu_hit)
            if plan is not None:
                count_miss(self.geometry, self.directory, plan, request.num_tokens, max(hit_tokens, gpu_hit))
        if plan is None:
            return
        plan.saves_allowed = plan.saves_allowed and saves
        if num_external_tokens <= 0 or plan.load_range is None:
            plan.load_range, plan.load_confirmed = None, False
            return
        start = plan.load_range[0]
        plan.load_range = (start, start + num_external_tokens)
        plan.load_confirmed = True
        self.metrics.count("hit_requests")  # its tokens: lmi_cache_load_tokens_total, counted with the lookup above
        if self.geometry.loads_async and block_ids is not None:
            plan.block_ids = self._per_group(block_ids)
            self._async_loads.add(request.request_id)

    # -- per-step planning ---------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> LmiConnectorMetadata:
        meta = LmiConnectorMetadata()
        for req_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            self._plans.pop(req_id, None)
            self._answered.pop(req_id, None)
            self._gpu_hit.pop(req_id, None)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.metrics.count("preemptions")
            plan = self._plans.get(req_id)
            if plan is not None:
                plan.block_ids, plan.load_range, plan.load_confirmed = [], None, False
        num_scheduled = scheduler_output.num_scheduled_tokens
        for req_id in sorted(self._async_loads):
            plan = self._plans.get(req_id)
            if plan is not None and plan.load_confirmed and plan.load_range is not None:
                self._plan_step(req_id, plan, plan.load_range[0], 0, meta)
                meta.async_loads.append(req_id)
        self._async_loads.clear()
        for new_req in scheduler_output.scheduled_new_reqs:
            plan = self._plans.get(new_req.req_id)
            if plan is None:
                continue
            plan.block_ids = self._per_group(new_req.block_ids)
            if self._sessions is not None and plan.session_id:
                self._sessions.note(plan.session_id, [tuple(k.digest for k in keys)
                                                      for group_keys in plan.chunk_keys for keys in group_keys])
            self._plan_step(new_req.req_id, plan, new_req.num_computed_tokens, num_scheduled.get(new_req.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self._plans.get(req_id)
            if plan is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                plan.block_ids = self._per_group(new_ids)
            elif new_ids:
                for ids, more in zip(plan.block_ids, new_ids):
                    ids.extend(more)
            self._plan_step(req_id, plan, cached.num_computed_tokens[i], num_scheduled.get(req_id, 0), meta)
        self._plan_state_saves(scheduler_output, meta)
        if self._sessions is not None:
            retention = self._sessions.take_step()
            for session in retention.release:
                self.directory.end_session(session)
            for session, chunks in retention.retain.items():
                self.directory.retain_for_session(session, [digest for digests in chunks for digest in digests])
            if retention.release:
                self.metrics.sessions_released(len(retention.release))
        return meta

    def finish_step(self, meta: LmiConnectorMetadata) -> None:
        """The step is planned (blending's jobs too): its evictions go out with it, its pins go."""
        meta.evictions = self.directory.take_evictions()
        if self._holders is not None:
            self._holders.note_evictions(meta.evictions.get(0, ()))
        meta.layout_known = self._layouts.known
        self.directory.end_step()

    def _per_group(self, block_ids: Sequence[Sequence[int]] | None) -> list[list[int]]:
        """vLLM's block ids (one list per KV cache group) as one list per group of ours."""
        ids = list(block_ids or ())
        return [list(ids[g.index]) if g.index < len(ids) else [] for g in self.geometry.groups]

    def _plan_state_saves(self, scheduler_output: SchedulerOutputView, meta: LmiConnectorMetadata) -> None:
        """Saves of the Mamba boundary states vLLM offers this step (only while build_connector_meta runs)."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        for req_id, entries in offers.items():
            plan = self._plans.get(req_id)
            if plan is not None:
                self.metrics.count("planned_saves", plan_state_saves(self.geometry, self.directory, req_id, plan,
                                                                     entries, meta))

    def _plan_step(self, req_id: str, plan: RequestPlan, num_computed_tokens: int, num_scheduled_tokens: int,
                   meta: LmiConnectorMetadata) -> None:
        self.metrics.count("planned_saves", plan_step(self.geometry, self.directory, req_id, plan,
                                                      num_computed_tokens, num_scheduled_tokens, meta))

    # -- feedback and lifecycle ----------------------------------------------------------

    def update_from_workers(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, LmiWorkerMeta):
            return
        self._layouts.update(worker_meta)
        for rank in set(worker_meta.stored) | set(worker_meta.failed) | set(worker_meta.dropped):
            self.directory.complete(rank, worker_meta.stored.get(rank, ()), worker_meta.failed.get(rank, ()),
                                    worker_meta.dropped.get(rank, ()))
        if self._holders is not None and self._advertised is not None:
            self._holders.note_reports(worker_meta.stored.get(0, ()),
                                       [*worker_meta.failed.get(0, ()), *worker_meta.dropped.get(0, ())],
                                       still_held=self._advertised.holds)

    def close(self) -> None:
        """Stop the peer lookups (their pool, the holder records' client and writer thread)."""
        if self._peer_lookups is not None:
            self._peer_lookups.close()

    def request_finished(self, req_id: str) -> None:
        self._plans.pop(req_id, None)
        self._answered.pop(req_id, None)
        self._gpu_hit.pop(req_id, None)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._plans)


def _num_prompt_tokens(request: RequestView) -> int:
    """The prompt's length, also for a prompt given as embeddings (no token ids)."""
    tokens = getattr(request, "prompt_token_ids", None)
    return len(tokens) if tokens is not None else int(getattr(request, "num_prompt_tokens", 0) or 0)

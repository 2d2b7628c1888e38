"""Scheduler half of blending: which requests to blend, which segments to store (vLLM scheduler process).

Torch-free bookkeeping beside the base connector's ``SchedulerSide``. Per
request with blendable segments (a ``blend_special_str`` separator in its
prompt, or explicit segment ends in ``kv_transfer_params["blend_segment_ends"]``):

* ``plan``: the segment keys (the deployment's ``KeySpace`` under its segment
  variant, with the request's own ``cache_salt`` and adapter identity from
  ``keys.key_inputs``, the segment's tokens alone; a request with multimodal
  items or prompt embeddings is not blended), which segments the tiers hold
  (one ``lookup`` per segment in the connector's placement directory, kept for
  the job), and ``segments.plan_blend`` after the exact prefix: vLLM's
  own hit plus the chunks the prefix path loads. An exact prefix hit always
  wins: the blend starts where it ends, so a prompt whose prefix chunks are
  cached is served from them exactly, and only segments after them are blended.
  The answer is the number of tokens the blend provides, or None when the
  prefix path serves the request alone.
* ``take_jobs``: on the step a request is first scheduled, its ``BlendJob``
  (pieces, block ids; each cached segment's load planned by the directory's
  ``prepare_load``: its source tier, and a promotion with room reserved) and
  one ``SegmentStore`` per segment no tier holds yet, into the tiers the
  directory reserved room in with ``prepare_store`` (each issued once across
  concurrent requests). A segment's layer-0 attention object (``layer0_reuse``)
  is placed the same way beside it, when the deployment can use it
  (``layer0_bytes_per_token``).

The connector's blending component (``lmi_cache.vllm_connector.blending``)
isolates a blended request's blocks from vLLM's prefix cache and keeps the
prefix path from saving them; this class only says which requests are blended.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry

from lmi_cache.blend.jobs import BlendConnectorMetadata, BlendJob, BlendPiece, SegmentStore, attention_key
from lmi_cache.blend.segments import BlendPlan, SegmentSplit, Span, plan_blend, split_segments
from lmi_cache.blend.settings import BlendConfigError, BlendSettings
from lmi_cache.keys.hashing import ChunkKey, KeySpace
from lmi_cache.keys.key_inputs import KeyRule
from lmi_cache.metrics.scheduler_series import BlendSchedulerMetrics
from lmi_cache.placement.directory import PlacementDirectory

logger = logging.getLogger(__name__)

# The deployment's key space for a KV layout tag (the connector builds it; segments use its variant below).
KeySpaceFactory = Callable[[str], KeySpace]

# Segment payloads ([layers, 2, T, heads, dim], K at positions 0..T-1) are not chunk payloads: own layout tag.
SEGMENT_LAYOUT_SUFFIX = "+blend-seg-v1"
# A segment is one "chunk" of itself: no segment is this long, so its key covers tokens [0, n) whatever n is.
SEGMENT_CHUNK_TOKENS = 2**31 - 1


def segment_key_space(space: KeySpace) -> KeySpace:
    """The key space of segments: the deployment's, with the segment layout tag and one chunk per segment.

    Both fields enter every key's seed, so a segment key never equals a prefix chunk key.
    """
    return replace(space, layout=space.layout + SEGMENT_LAYOUT_SUFFIX, chunk_size=SEGMENT_CHUNK_TOKENS)

# Per-request keys of ``kv_transfer_params`` (SamplingParams.extra_args["kv_transfer_params"]).
SEGMENT_ENDS_PARAM = "blend_segment_ends"  # explicit segment ends (token offsets) instead of the separator
BLEND_PARAM = "blend"  # false: the exact prefix path only; its segments are not stored either
RATIOS_PARAM = "blend_recompute_ratios"  # this request's recompute ratios (one per check layer, or one)


class BlendRequestError(ValueError):
    """A request's explicit segment boundaries are malformed (the request is served without blending)."""


@dataclass
class _BlendState:
    prompt: list[int]
    split: SegmentSplit
    segment_keys: list[tuple[ChunkKey, ...]]  # per segment, per rank
    sources: list[str | None] = field(default_factory=list)  # per segment: the tier holding it (the plan's lookup)
    opted_out: bool = False
    ratios: tuple[float, ...] | None = None
    blend: BlendPlan | None = None
    num_computed_tokens: int = 0  # vLLM's own hit when ``blend`` was planned
    confirmed: bool = False
    stores_issued: bool = False


class BlendSchedulerStats:
    """What a blend scheduler counted, read from its ``lmi_cache_blend_*`` series (each event is counted there once)."""

    def __init__(self, metrics: BlendSchedulerMetrics) -> None:
        self._metrics = metrics

    def snapshot(self) -> dict[str, float]:
        return self._metrics.counts()

    @property
    def num_blend_plans(self) -> float:  # requests admitted with a blend
        return self.snapshot()["num_blend_plans"]

    @property
    def num_blend_tokens(self) -> float:  # tokens served from cached segments
        return self.snapshot()["num_blend_tokens"]

    @property
    def num_segment_stores(self) -> float:  # segment stores issued to the workers
        return self.snapshot()["num_segment_stores"]

    @property
    def num_bad_requests(self) -> float:
        return self.snapshot()["num_bad_requests"]


def explicit_split(ends: Any, num_tokens: int) -> SegmentSplit:
    """Segments from ``kv_transfer_params["blend_segment_ends"]``: increasing token offsets, each a segment's end."""
    if not isinstance(ends, (list, tuple)) or not ends or not all(isinstance(e, int) and not isinstance(e, bool) for e in ends):
        raise BlendRequestError(f"{SEGMENT_ENDS_PARAM}: expected a non-empty list of token offsets, got {ends!r}")
    if any(b <= a for a, b in zip(ends, ends[1:])) or ends[0] <= 0 or ends[-1] > num_tokens:
        raise BlendRequestError(
            f"{SEGMENT_ENDS_PARAM}: offsets must increase within (0, {num_tokens}], got {list(ends)[:8]}"
        )
    starts = [0, *ends[:-1]]
    return SegmentSplit(tuple(Span(s, e) for s, e in zip(starts, ends)), Span(ends[-1], num_tokens))


class BlendScheduler:
    """Blend bookkeeping for one scheduler; see the module docstring."""

    def __init__(
        self, settings: BlendSettings, separator_ids: Sequence[int], key_space: KeySpaceFactory,
        directory: PlacementDirectory, metrics: BlendSchedulerMetrics | None = None,
        layer0_bytes_per_token: int = 0,
    ) -> None:
        self.settings = settings
        self._sep = tuple(separator_ids)
        self._key_space = key_space
        self._key_rule = KeyRule()  # the same rule as the prefix path's keys (adapter content, salt)
        self._segment_spaces: dict[str, KeySpace] = {}  # per layout tag
        self.directory = directory  # the connector's: segments are placed like every other entry
        # Each rank's bytes per token of a segment's layer-0 attention object (0: the workers cannot reuse it,
        # none is placed).
        self._layer0_bytes_per_token = layer0_bytes_per_token
        self._states: dict[str, _BlendState] = {}
        # lmi_cache_blend_* series of this scheduler (None: in a registry of its own); ``stats`` reads them.
        self.metrics = metrics if metrics is not None else BlendSchedulerMetrics(CollectorRegistry())
        self.stats = BlendSchedulerStats(self.metrics)

    def _bad_request(self) -> None:
        self.metrics.bad_request()

    def state(self, req_id: str) -> _BlendState | None:
        return self._states.get(req_id)

    def _split(self, request: Any, prompt: list[int]) -> SegmentSplit | None:
        params = getattr(request, "kv_transfer_params", None) or {}
        if isinstance(params, dict) and params.get(SEGMENT_ENDS_PARAM) is not None:
            return explicit_split(params[SEGMENT_ENDS_PARAM], len(prompt))
        split = split_segments(prompt, self._sep)
        return split if split.segments else None

    def _new_state(self, request: Any, layout_tag: str) -> _BlendState | None:
        inputs = self._key_rule.inputs(request)
        if not inputs.is_plain_text or inputs.uncacheable is not None:
            # A segment's KV is computed from its token ids alone: an image's placeholders or prompt
            # embeddings would be stored as text. Such requests take the exact prefix path only.
            return None
        prompt = list(inputs.tokens)
        try:
            split = self._split(request, prompt)
        except BlendRequestError as err:
            self._bad_request()
            logger.warning("lmi-cache: request %s served without blending: %s", request.request_id, err)
            return None
        if split is None:
            return None
        space = self._segment_spaces.get(layout_tag)
        if space is None:
            space = self._segment_spaces[layout_tag] = segment_key_space(self._key_space(layout_tag))
        keys = [space.for_request(prompt[span.start : span.end], inputs.adapter, inputs.cache_salt,
                                  include_partial=True).per_chunk[0]
                for span in split.segments]
        state = _BlendState(prompt, split, keys)
        params = getattr(request, "kv_transfer_params", None) or {}
        if isinstance(params, dict):
            state.opted_out = params.get(BLEND_PARAM, True) is False
            if params.get(RATIOS_PARAM) is not None:
                try:
                    state.ratios = BlendSettings.from_mapping(
                        {"blend_check_layers": list(self.settings.check_layers), "blend_recompute_ratios": params[RATIOS_PARAM]},
                        f"request {request.request_id} kv_transfer_params",
                    ).recompute_ratios
                except BlendConfigError as err:
                    self._bad_request()
                    logger.warning("lmi-cache: %s; using the configured ratios", err)
        return state

    def plan(self, request: Any, num_computed_tokens: int, prefix_path_end: int, layout_tag: str) -> int | None:
        """External tokens beyond ``num_computed_tokens`` (vLLM's hit) with the blend, or None (prefix path alone).

        ``prefix_path_end``: where the exact prefix path (vLLM's hit plus the chunk
        cache) ends. Those tokens stay exact: the blend starts there, and the
        answer counts the prefix path's chunks too.
        """
        state = self._states.get(request.request_id)
        if state is None:
            state = self._new_state(request, layout_tag)
            if state is None:
                return None
            self._states[request.request_id] = state
        state.blend, state.confirmed = None, False
        if not self.settings.enabled or state.opted_out:
            return None
        state.sources = [self.directory.lookup(keys) for keys in state.segment_keys]
        cached = [source is not None for source in state.sources]
        blend = plan_blend(state.split, max(prefix_path_end, num_computed_tokens), cached, self.settings.min_tokens)
        if blend is None or blend.tail.num_tokens == 0:
            return None
        state.blend, state.num_computed_tokens = blend, num_computed_tokens
        return blend.tail.start - num_computed_tokens

    def confirm(self, req_id: str, num_external_tokens: int) -> int | None:
        """After vLLM allocated ``num_external_tokens``: the prefix path's share of them if the blend stands, else None."""
        state = self._states.get(req_id)
        if state is None or state.blend is None:
            return None
        if num_external_tokens != state.blend.tail.start - state.num_computed_tokens:
            state.blend, state.confirmed = None, False  # vLLM took a different hit: no blend
            return None
        state.confirmed = True
        self.metrics.blended(state.blend.blended_tokens)
        return state.blend.prefix_tokens - state.num_computed_tokens

    def take_jobs(self, scheduler_output: Any, meta: BlendConnectorMetadata) -> None:
        """Add this step's blends and segment stores to ``meta``."""
        for req_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            self._states.pop(req_id, None)
        for new_req in scheduler_output.scheduled_new_reqs:
            block_ids = list(new_req.block_ids[0]) if new_req.block_ids else []
            self._jobs_for(new_req.req_id, block_ids, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                new_ids = cached.new_block_ids[i]
                self._jobs_for(req_id, list(new_ids[0]) if new_ids else [], meta)

    def _jobs_for(self, req_id: str, block_ids: list[int], meta: BlendConnectorMetadata) -> None:
        state = self._states.get(req_id)
        if state is None:
            return
        if state.confirmed and state.blend is not None:
            blend = state.blend
            pieces: list[BlendPiece] = []
            for span, hit in blend.pieces:
                pieces.append(self._piece(state, span) if hit else BlendPiece(span.start, span.end, None))
            tokens = tuple(state.prompt[blend.prefix_tokens : blend.tail.start])
            meta.blends.append(
                BlendJob(req_id, blend.prefix_tokens, tokens, tuple(pieces), tuple(block_ids), state.ratios)
            )
        state.blend, state.confirmed = None, False
        if state.stores_issued or state.opted_out:
            return  # an opted-out request neither blends nor stores segments
        state.stores_issued = True
        for span, keys in zip(state.split.segments, state.segment_keys):
            tiers = self.directory.prepare_store(keys, 0, span.end - span.start)
            if not tiers:
                continue  # held, being stored, or no room now
            attention_tiers: tuple[str, ...] = ()
            if self._layer0_bytes_per_token:
                attention_tiers = self.directory.prepare_store(
                    [attention_key(k) for k in keys], 0, payload_bytes=self._attention_bytes(span))
            meta.segment_stores.append(SegmentStore(req_id, tuple(state.prompt[span.start : span.end]), keys, tiers,
                                                    attention_tiers))
            self.metrics.segment_stores()

    def _attention_bytes(self, span: Span) -> int:
        return (span.end - span.start) * self._layer0_bytes_per_token

    def _piece(self, state: _BlendState, span: Span) -> BlendPiece:
        """A cached segment's piece, its loads planned (the source the plan's lookup found, promotions)."""
        number = state.split.segments.index(span)
        keys, source = state.segment_keys[number], state.sources[number]
        assert source is not None, "a blend piece from a segment no tier holds"
        first = self.directory.first_tier_name
        placed = self.directory.prepare_load(keys, 0, source)
        piece = BlendPiece(span.start, span.end, keys, source, first if placed.promote else "")
        attention = [attention_key(k) for k in keys]
        found = self.directory.lookup(attention) if self._layer0_bytes_per_token else None
        if found is None:
            return piece
        placed = self.directory.prepare_load(attention, 0, found, payload_bytes=self._attention_bytes(span))
        return replace(piece, attention_source=found, attention_promote_to=first if placed.promote else "")

    def finished(self, req_id: str) -> _BlendState | None:
        return self._states.pop(req_id, None)

"""Scheduler half of blending: which requests to blend, which segments to store (vLLM scheduler process).

Torch-free bookkeeping beside the base connector's ``SchedulerSide``. Per
request with blendable segments (a ``blend_special_str`` separator in its
prompt, or explicit segment ends in ``kv_transfer_params["blend_segment_ends"]``):

* ``plan``: the segment keys (namespace with the request's own ``cache_salt`` and
  LoRA, the segment's tokens alone), which segments the workers hold (an index
  fed by the digests their engines report), and ``segments.plan_blend`` after
  vLLM's own exact prefix hit. The answer is the number of tokens the blend
  provides, or None when the prefix path serves the request better.
* ``take_jobs``: on the step a request is first scheduled, its ``BlendJob``
  (pieces, block ids) and one ``SegmentStore`` per segment no worker holds yet
  (each issued once across concurrent requests).

The connector isolates a blended request from vLLM's prefix cache (see
``LmiBlendConnector``); this class only says which requests are blended.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmi_cache.blend.jobs import BlendConnectorMetadata, BlendJob, BlendPiece, SegmentStore
from lmi_cache.blend.segments import BlendPlan, SegmentSplit, Span, plan_blend, split_segments
from lmi_cache.blend.settings import BlendConfigError, BlendSettings
from lmi_cache.vllm_connector.key_index import KeyIndex

if TYPE_CHECKING:
    from lmi_cache.metrics.series import BlendSchedulerMetrics

logger = logging.getLogger(__name__)

# (segment token ids, rank, layout tag, lora name, cache salt) -> that rank's segment key (a ChunkKey).
SegmentKeyFn = Callable[[Sequence[int], int, str, "str | None", "str | None"], Any]

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
    segment_keys: list[tuple[Any, ...]]  # per segment, per rank
    original_salt: str | None
    opted_out: bool = False
    ratios: tuple[float, ...] | None = None
    blend: BlendPlan | None = None
    confirmed: bool = False
    stores_issued: bool = False
    isolated: bool = False  # the connector salted its vLLM block hashes


@dataclass
class BlendSchedulerStats:
    num_blend_plans: int = 0  # requests admitted with a blend
    num_blend_tokens: int = 0  # tokens served from cached segments
    num_segment_stores: int = 0  # segment stores issued to the workers
    num_bad_requests: int = 0
    requests_blended: list[str] = field(default_factory=list)


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
        self, settings: BlendSettings, separator_ids: Sequence[int], world_size: int, segment_key_fn: SegmentKeyFn,
        metrics: BlendSchedulerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self._sep = tuple(separator_ids)
        self._world_size = world_size
        self._key_fn = segment_key_fn
        self.index = KeyIndex()
        self._states: dict[str, _BlendState] = {}
        self.stats = BlendSchedulerStats()
        self.metrics = metrics  # lmi_cache_blend_* series of this scheduler (None: plain stats only)

    def _bad_request(self) -> None:
        self.stats.num_bad_requests += 1
        if self.metrics is not None:
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
        prompt = list(request.prompt_token_ids or [])
        try:
            split = self._split(request, prompt)
        except BlendRequestError as err:
            self._bad_request()
            logger.warning("lmi-cache: request %s served without blending: %s", request.request_id, err)
            return None
        if split is None:
            return None
        lora = getattr(request, "lora_request", None)
        lora_name = getattr(lora, "lora_name", None) if lora is not None else None
        salt = getattr(request, "cache_salt", None)
        keys = [
            tuple(self._key_fn(prompt[span.start : span.end], rank, layout_tag, lora_name, salt) for rank in range(self._world_size))
            for span in split.segments
        ]
        state = _BlendState(prompt, split, keys, salt)
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
        """External tokens the blend provides beyond ``num_computed_tokens``, or None (prefix path).

        ``prefix_path_end``: where the exact prefix path (vLLM's hit plus the chunk
        cache) would end; a blend that does not reach past it is not worth it.
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
        cached = [self.index.has_all(keys) for keys in state.segment_keys]
        blend = plan_blend(state.split, num_computed_tokens, cached, self.settings.min_tokens)
        if blend is None or blend.tail.num_tokens == 0 or blend.tail.start <= prefix_path_end:
            return None
        state.blend = blend
        return blend.tail.start - num_computed_tokens

    def confirm(self, req_id: str, num_external_tokens: int) -> None:
        state = self._states.get(req_id)
        if state is None or state.blend is None:
            return
        if num_external_tokens != state.blend.tail.start - state.blend.prefix_tokens:
            state.blend, state.confirmed = None, False  # vLLM took a different hit: no blend
            return
        state.confirmed = True
        self.stats.num_blend_plans += 1
        self.stats.num_blend_tokens += state.blend.blended_tokens
        if self.metrics is not None:
            self.metrics.blended(state.blend.blended_tokens)
        self.stats.requests_blended.append(req_id)

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
        self.index.next_step()

    def _jobs_for(self, req_id: str, block_ids: list[int], meta: BlendConnectorMetadata) -> None:
        state = self._states.get(req_id)
        if state is None:
            return
        if state.confirmed and state.blend is not None:
            blend = state.blend
            pieces: list[BlendPiece] = []
            for span, hit in blend.pieces:
                keys = self._keys_of(state, span) if hit else None
                pieces.append(BlendPiece(span.start, span.end, keys))
            tokens = tuple(state.prompt[blend.prefix_tokens : blend.tail.start])
            meta.blends.append(
                BlendJob(req_id, blend.prefix_tokens, tokens, tuple(pieces), tuple(block_ids), state.ratios)
            )
        state.blend, state.confirmed = None, False
        if state.stores_issued or state.opted_out:
            return  # an opted-out request neither blends nor stores segments
        state.stores_issued = True
        for span, keys in zip(state.split.segments, state.segment_keys):
            if self.index.has_all(keys) or self.index.save_pending(keys):
                continue
            meta.segment_stores.append(SegmentStore(req_id, tuple(state.prompt[span.start : span.end]), keys))
            self.index.mark_save_pending(keys)
            self.stats.num_segment_stores += 1
            if self.metrics is not None:
                self.metrics.segment_stores()

    @staticmethod
    def _keys_of(state: _BlendState, span: Span) -> tuple[Any, ...]:
        for seg, keys in zip(state.split.segments, state.segment_keys):
            if seg == span:
                return keys
        raise ValueError(f"no segment {span} in the request's split")

    def update_from_workers(self, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        self.index.add(stored)
        self.index.discard(removed)

    def finished(self, req_id: str) -> _BlendState | None:
        return self._states.pop(req_id, None)

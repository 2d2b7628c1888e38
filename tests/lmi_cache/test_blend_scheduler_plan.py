"""BlendScheduler: which requests blend, what the workers are asked to do (no vLLM, plain fakes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from lmi_cache.blend.jobs import BlendConnectorMetadata, attention_key
from lmi_cache.placement.messages import TierEvent
from lmi_cache.blend.scheduler_plan import BlendRequestError, BlendScheduler, explicit_split, segment_key_space
from lmi_cache.blend.segments import Span
from lmi_cache.blend.settings import BlendSettings
from lmi_cache.keys.hashing import KeySpace
from placement_helpers import confirm_stored, directory

SEP = (9, 9)


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: Any = None


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Any] = field(default_factory=list)


@dataclass
class Output:
    scheduled_new_reqs: list[NewReq]
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    finished_req_ids: set[str] = field(default_factory=set)


def _space(layout: str, tp_size: int = 2) -> KeySpace:
    return KeySpace(model="m", kv_dtype="float32", layout=layout, chunk_size=4, tp_size=tp_size)


def _scheduler(**settings: Any) -> BlendScheduler:
    return BlendScheduler(BlendSettings(enabled=True, min_tokens=4, **settings), SEP, _space, directory(4))


def _doc(value: int, n: int = 10) -> list[int]:
    return [value] * n + list(SEP)


PROMPT = _doc(1) + _doc(2) + _doc(3) + [5, 6, 7]


def _hold_all(sched: BlendScheduler, req: FakeRequest) -> None:
    state = sched.state(req.request_id)
    assert state is not None
    confirm_stored(sched.directory, state.segment_keys)


def _held() -> tuple[BlendScheduler, FakeRequest]:
    """A scheduler that planned request "a" for PROMPT once, whose segments the workers now hold."""
    sched = _scheduler()
    req = FakeRequest("a", PROMPT)
    sched.plan(req, 0, 0, "L")
    _hold_all(sched, req)
    return sched, req


def test_a_cold_request_is_not_blended_and_stores_each_segment_once() -> None:
    sched = _scheduler()
    a, b = FakeRequest("a", PROMPT), FakeRequest("b", PROMPT)
    assert sched.plan(a, 0, 0, "L") is None and sched.plan(b, 0, 0, "L") is None
    meta = BlendConnectorMetadata()
    sched.take_jobs(Output([NewReq("a", ([1, 2],)), NewReq("b", ([3, 4],))]), meta)
    assert not meta.blends
    assert [len(s.token_ids) for s in meta.segment_stores] == [12, 12, 12]  # one per segment, not per request
    assert all(len(s.keys) == 2 for s in meta.segment_stores)  # one key per rank


def test_cached_segments_blend_up_to_the_tail() -> None:
    sched, req = _held()
    assert sched.plan(req, 0, 0, "L") == 36  # every segment; the 3-token question is prefilled
    sched.confirm("a", 36)
    meta = BlendConnectorMetadata()
    sched.take_jobs(Output([NewReq("a", ([5, 6, 7],))]), meta)
    (job,) = meta.blends
    assert job.prefix_tokens == 0 and job.end == 36 and job.block_ids == (5, 6, 7)
    assert [(p.start, p.end, p.keys is not None) for p in job.pieces] == [(0, 12, True), (12, 24, True), (24, 36, True)]
    assert not meta.segment_stores


def test_vllm_prefix_hit_cuts_a_segment_which_is_then_computed() -> None:
    sched, req = _held()
    assert sched.plan(req, 8, 8, "L") == 28
    sched.confirm("a", 28)
    meta = BlendConnectorMetadata()
    sched.take_jobs(Output([NewReq("a", ([5, 6, 7],))]), meta)
    assert [(p.start, p.end, p.keys is not None) for p in meta.blends[0].pieces] == [
        (8, 12, False), (12, 24, True), (24, 36, True)]


def test_the_prefix_path_wins_when_it_reaches_as_far() -> None:
    sched, req = _held()
    assert sched.plan(req, 0, 36, "L") is None
    # Chunks cut into the last segment: what is left of it is not cached, so there is nothing to blend.
    assert sched.plan(req, 0, 28, "L") is None


def test_an_exact_prefix_hit_stays_exact_and_the_blend_starts_after_it() -> None:
    sched, req = _held()
    # vLLM holds 4 tokens, the chunk cache 12 more: the blend covers [16, 36), the prefix path loads [4, 16).
    assert sched.plan(req, 4, 16, "L") == 32
    assert sched.confirm("a", 32) == 12
    meta = BlendConnectorMetadata()
    sched.take_jobs(Output([NewReq("a", ([5, 6, 7],))]), meta)
    (job,) = meta.blends
    assert job.prefix_tokens == 16 and job.end == 36
    assert [(p.start, p.end, p.keys is not None) for p in job.pieces] == [(16, 24, False), (24, 36, True)]


def test_segment_keys_come_from_the_key_space_and_never_equal_chunk_keys() -> None:
    sched = _scheduler()
    moved = FakeRequest("b", _doc(3) + _doc(1) + [4])  # the same documents, elsewhere in the prompt
    for req in (FakeRequest("a", PROMPT), moved, FakeRequest("s", PROMPT, cache_salt="t2")):
        sched.plan(req, 0, 0, "L")
    a, b, salted = (sched.state(r) for r in ("a", "b", "s"))
    assert a is not None and b is not None and salted is not None
    assert b.segment_keys == [a.segment_keys[2], a.segment_keys[0]]  # a segment's key ignores its position
    assert not {k.digest for keys in salted.segment_keys for k in keys} & {k.digest for keys in a.segment_keys for k in keys}
    assert all(len({k.digest for k in keys}) == 2 for keys in a.segment_keys)  # one key per rank
    assert all(keys[0].start == 0 and keys[0].end == 12 for keys in a.segment_keys)
    chunk_digests = {k.digest for keys in _space("L").for_request(_doc(1)[:12], include_partial=True).per_chunk for k in keys}
    assert not chunk_digests & {k.digest for k in a.segment_keys[0]}
    assert segment_key_space(_space("L")).layout != "L"


def test_opt_out_salt_and_min_tokens() -> None:
    sched = _scheduler()
    req = FakeRequest("a", PROMPT, kv_transfer_params={"blend": False})
    sched.plan(req, 0, 0, "L")
    _hold_all(sched, req)
    assert sched.plan(req, 0, 0, "L") is None
    opted = FakeRequest("o", PROMPT + [8], kv_transfer_params={"blend": False})
    sched.plan(opted, 0, 0, "L")
    meta = BlendConnectorMetadata()
    sched.take_jobs(Output([NewReq("o", ([1],))]), meta)
    assert not meta.segment_stores  # an opted-out request stores nothing either
    # Another tenant's salt keys other segments: nothing is held for it.
    assert sched.plan(FakeRequest("b", PROMPT, cache_salt="t2"), 0, 0, "L") is None
    strict = BlendScheduler(BlendSettings(enabled=True, min_tokens=100), SEP, lambda layout: _space(layout, 1), directory(4))
    req = FakeRequest("c", PROMPT)
    strict.plan(req, 0, 0, "L")
    _hold_all(strict, req)
    assert strict.plan(req, 0, 0, "L") is None


def test_a_different_admitted_hit_drops_the_blend() -> None:
    sched, req = _held()
    sched.plan(req, 0, 0, "L")
    sched.confirm("a", 12)
    meta = BlendConnectorMetadata()
    sched.take_jobs(Output([NewReq("a", ([5],))]), meta)
    assert not meta.blends


def test_per_request_ratios_travel_with_the_job() -> None:
    sched = _scheduler()
    req = FakeRequest("a", PROMPT, kv_transfer_params={"blend_recompute_ratios": [1.0]})
    sched.plan(req, 0, 0, "L")
    _hold_all(sched, req)
    sched.confirm("a", sched.plan(req, 0, 0, "L") or 0)
    meta = BlendConnectorMetadata()
    sched.take_jobs(Output([NewReq("a", ([5, 6, 7],))]), meta)
    assert meta.blends[0].recompute_ratios == (1.0,)


def test_explicit_segment_ends() -> None:
    split = explicit_split([12, 30], 40)
    assert split.segments == (Span(0, 12), Span(12, 30)) and split.tail == Span(30, 40)
    for bad in ([], [0], [12, 12], [50], "12", [True]):
        with pytest.raises(BlendRequestError, match="blend_segment_ends"):
            explicit_split(bad, 40)
    sched = _scheduler()
    req = FakeRequest("a", [1] * 40, kv_transfer_params={"blend_segment_ends": [12, 30]})
    assert sched.plan(req, 0, 0, "L") is None
    assert [(s.start, s.end) for s in sched.state("a").split.segments] == [(0, 12), (12, 30)]  # type: ignore[union-attr]
    assert sched.plan(FakeRequest("b", [1] * 40, kv_transfer_params={"blend_segment_ends": [50]}), 0, 0, "L") is None
    assert sched.stats.num_bad_requests == 1


def test_segments_and_their_layer0_objects_are_placed_and_loaded_from_where_the_directory_says() -> None:
    sched = BlendScheduler(BlendSettings(enabled=True, min_tokens=4), SEP, _space, directory(4),
                           layer0_bytes_per_token=8)
    req = FakeRequest("a", PROMPT)
    assert sched.plan(req, 0, 0, "L") is None
    meta = BlendConnectorMetadata()
    sched.take_jobs(Output([NewReq("a", ([1, 2],))]), meta)
    assert [(s.tiers, s.attention_tiers) for s in meta.segment_stores] == [(("cpu",), ("cpu",))] * 3
    cpu = sched.directory.books[0]
    for store in meta.segment_stores:  # every rank's segment and layer-0 object took room (pending)
        assert all(cpu.knows(k.digest) and cpu.knows(attention_key(k).digest) for k in store.keys)
    for store in meta.segment_stores:
        for rank, k in enumerate(store.keys):
            sched.directory.complete(rank, stored=[TierEvent("cpu", k.digest), TierEvent("cpu", attention_key(k).digest)])
    sched.directory.end_step()
    again = FakeRequest("b", PROMPT)
    assert sched.plan(again, 0, 0, "L") == 36
    sched.confirm("b", 36)
    meta = BlendConnectorMetadata()
    sched.take_jobs(Output([NewReq("b", ([5, 6, 7],))]), meta)
    (job,) = meta.blends
    assert [(p.source, p.promote_to, p.attention_source) for p in job.pieces] == [("cpu", "", "cpu")] * 3
    registry = sched.directory.metrics.registry  # every store was planned
    assert registry.get_sample_value("lmi_cache_placement_unplanned_stores_total", {"engine": "0", "tier": "cpu"}) is None

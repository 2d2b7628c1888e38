"""Paired A/B no-reuse throughput against two fake servers of known speeds."""
from __future__ import annotations

import asyncio

from lmi_cache.bench.fake_server import FakeOpenAiServer, FakeServerState
from lmi_cache.bench.paired import paired_no_reuse
from lmi_cache.bench.workloads import LongDocQaSpec


def test_paired_ratio_reflects_the_slower_server() -> None:
    spec = LongDocQaSpec(num_documents=4, document_tokens=2000, query_tokens=4, output_tokens=2, seed=3)
    fast = FakeServerState(prefill_s_per_token=0.00005, decode_s_per_token=0.0)
    slow = FakeServerState(prefill_s_per_token=0.0001, decode_s_per_token=0.0)
    with FakeOpenAiServer(fast) as a, FakeOpenAiServer(slow) as b:
        result = asyncio.run(paired_no_reuse(a.url, b.url, "fake-model", spec, pause_s=0.0))
    assert result.num_requests == 4
    # B prefills at half A's speed: its throughput is about half.
    assert 0.35 < result.ratio < 0.65
    assert 0.35 < result.median_pair_ratio < 0.65
    # Every document went to both servers once (plus one unmeasured primer each).
    assert len(fast.prompts) == len(slow.prompts) == 5
    assert fast.prompts[1:] == slow.prompts[1:]
    assert len(set(fast.prompts[1:])) == 4

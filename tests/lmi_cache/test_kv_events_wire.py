"""The directory's changes as vLLM's own events, on the wire both ways vLLM has encoded them, read by llm-d's
and Dynamo's rules (imports vLLM; starts no server)."""
from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest

from lmi_cache.placement.events import ChunkBlocks, RemovedBlocks, StoredBlocks, parents_first
from tests.kv_event_consumers import DynamoIndex, LlmdIndex, apply_all, decode_events

pytestmark = pytest.mark.vllm

BLOCK = 4
MODEL = "tiny"


def chunk_blocks(tokens: list[int], chunk: int, per_chunk: int = 2) -> ChunkBlocks:
    """A chunk's description with vLLM-like engine hashes: any distinct integers serve (routers map them)."""
    first = chunk * per_chunk
    return ChunkBlocks(tuple(1000 + b for b in range(first, first + per_chunk)), 1000 + first - 1 if first else None,
                       tuple(tokens[first * BLOCK : (first + per_chunk) * BLOCK]), BLOCK,
                       kv_cache_spec_kind="full_attention")


def encode(events: list[Any], positional: bool) -> bytes:
    """vLLM's batch encoding (tagged maps), or the older one with each event a positional array, tag first."""
    from vllm.distributed.kv_events import KVEventBatch

    if not positional:
        return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
    arrays = [[type(e).__name__, *(getattr(e, f.name) for f in msgspec.structs.fields(e))] for e in events]
    return msgspec.msgpack.encode([0.0, arrays, None])


@pytest.mark.parametrize("positional", [False, True], ids=["tagged-maps", "positional-arrays"])
def test_both_consumers_follow_stores_demotions_and_removals(positional: bool) -> None:
    from lmi_cache.vllm_connector.kv_events import to_vllm_events

    tokens = list(range(1, 17))  # four blocks: two chunks of two blocks
    first, second = chunk_blocks(tokens, 0), chunk_blocks(tokens, 1)
    llmd, dynamo = LlmdIndex(BLOCK, MODEL), DynamoIndex(BLOCK)

    def deliver(changes: list[Any]) -> None:
        apply_all(decode_events(encode(to_vllm_events(changes), positional)), llmd, dynamo)

    deliver([StoredBlocks("CPU", first), StoredBlocks("CPU", second)])
    assert llmd.tiers_of(tokens) == [{"cpu"}] * 4
    assert dynamo.matched_blocks("host", tokens) == 4
    deliver([StoredBlocks("STORAGE", first), RemovedBlocks("CPU", first.block_hashes)])
    assert llmd.tiers_of(tokens) == [{"storage"}, {"storage"}, {"cpu"}, {"cpu"}]
    assert dynamo.matched_blocks("host", tokens) == 0  # the chain starts with the removed blocks
    assert dynamo.matched_blocks("device", tokens) == 2  # Dynamo files vLLM's STORAGE medium under its default tier
    assert llmd.dropped == 0 and dynamo.dropped == 0


def test_a_batch_confirmed_child_first_reaches_both_consumers_whole_once_ordered() -> None:
    """A promotion that lands a prompt's second chunk before its first: as confirmed, Dynamo indexes only the
    first chunk (the second's parent was unknown when it came); in the order the event log publishes, both."""
    from lmi_cache.vllm_connector.kv_events import to_vllm_events

    tokens = list(range(1, 17))
    first, second = chunk_blocks(tokens, 0), chunk_blocks(tokens, 1)
    as_confirmed = [StoredBlocks("CPU", second), StoredBlocks("CPU", first)]
    for batch, host_blocks in ((as_confirmed, 2), (parents_first(as_confirmed), 4)):
        llmd, dynamo = LlmdIndex(BLOCK, MODEL), DynamoIndex(BLOCK)
        apply_all(decode_events(encode(to_vllm_events(batch), False)), llmd, dynamo)
        assert dynamo.matched_blocks("host", tokens) == host_blocks


def test_lora_name_and_block_size_are_what_the_consumers_hash_with() -> None:
    from lmi_cache.vllm_connector.kv_events import to_vllm_events

    tokens = list(range(1, 9))
    adapted = dataclasses.replace(chunk_blocks(tokens, 0), lora_name="sql-adapter")
    llmd, dynamo = LlmdIndex(BLOCK, MODEL), DynamoIndex(BLOCK)
    apply_all(decode_events(encode(to_vllm_events([StoredBlocks("CPU", adapted)]), False)), llmd, dynamo)
    assert llmd.tiers_of(tokens) == [set(), set()]  # the base model's keys differ from the adapter's
    assert all(llmd.entries.get(k) for k in llmd.request_keys(tokens, model="sql-adapter"))
    wrong_size = DynamoIndex(BLOCK * 2)  # a router configured with another block size indexes nothing
    apply_all(decode_events(encode(to_vllm_events([StoredBlocks("CPU", chunk_blocks(tokens, 0))]), False)),
              wrong_size)
    assert wrong_size.matched_blocks("host", tokens) == 0


def test_an_unknown_parent_is_dropped_by_both_consumers() -> None:
    """Why the parent chain matters: a chunk announced without its parent ever seen is not routable."""
    from lmi_cache.vllm_connector.kv_events import to_vllm_events

    tokens = list(range(1, 17))
    llmd, dynamo = LlmdIndex(BLOCK, MODEL), DynamoIndex(BLOCK)
    apply_all(decode_events(encode(to_vllm_events([StoredBlocks("CPU", chunk_blocks(tokens, 1))]), False)),
              llmd, dynamo)
    assert llmd.dropped == 1 and dynamo.dropped == 1

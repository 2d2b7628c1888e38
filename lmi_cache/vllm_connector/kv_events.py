"""The connector's KV events in vLLM's own format, on vLLM's own stream (vLLM scheduler process).

With ``--kv-events-config`` (``enable_kv_cache_events``), vLLM's scheduler
publishes its GPU prefix cache's events and, after each step, whatever the
connector's ``take_events`` returns, in the same batch on the same ZMQ
publisher. The placement directory decides what the CPU and disk tiers hold
(``lmi_cache.placement.events``); this module says it the way vLLM's own
events do:

- ``chunk_blocks(request, group, chunk)``: vLLM's block hashes of the blocks a
  chunk covers (``request.block_hashes``, converted as vLLM converts them for
  events), the parent block's hash, the chunk's token ids, the engine's block
  size, the LoRA adapter, the per-block extra keys (multimodal items, salt),
  the KV cache group and its spec kind;
- ``to_vllm_events``: ``BlockStored`` / ``BlockRemoved`` with ``medium`` ``CPU``
  or ``STORAGE`` and ``locality`` ``LOCAL`` (the tier is this server's own).

Only models whose KV is one full-attention group publish (``EventShape``):
a hit of a model with sliding-window or state groups needs every group's chunk
at once, which one group's blocks cannot say, so a router would be told about
prefixes this server cannot serve. The remote store is not published: it is
shared by the fleet and evicts on its own, so no server knows what it holds,
and every server reads it alike (it carries no routing signal).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.placement.event_journal import EventJournal
from lmi_cache.placement.events import ChunkBlocks, RemovedBlocks, StoredBlocks, TierChange

logger = logging.getLogger(__name__)

# The tiers are this server's own (vLLM's Locality.LOCAL); a consumer that scopes by locality keeps them.
LOCALITY = "LOCAL"


@dataclass(frozen=True)
class EventShape:
    """What every event of this deployment says of its blocks."""

    block_size_tokens: int
    chunk_size_tokens: int
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


def event_blocks_reader(vllm_config: Any, kv_cache_config: Any, block_size_tokens: int, chunk_size_tokens: int,
                        directory: PlacementDirectory, journal: str | None = None,
                        ) -> Callable[[Any, int, int], ChunkBlocks | None] | None:
    """With vLLM's KV events on (``--kv-events-config``), turn the directory's events on (``journal``: where the
    disk tier's chunk descriptions are kept across restarts) and return the reader of what each chunk's events
    say; None when they are off or the model does not publish (see the docstring)."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    if events_config is None or not getattr(events_config, "enable_kv_cache_events", False):
        return None
    shape = event_shape(kv_cache_config, block_size_tokens, chunk_size_tokens)
    if shape is None:
        logger.warning("lmi-cache: KV events of the CPU and disk tiers are not published for a model whose KV is "
                       "not one full-attention group (vLLM's GPU events still are)")
        return None
    directory.enable_events(EventJournal(journal) if journal else None)
    logger.info("lmi-cache: publishing the CPU and disk tiers' KV events on vLLM's KV event stream")
    return partial(chunk_blocks, shape)


def event_shape(kv_cache_config: Any, block_size_tokens: int, chunk_size_tokens: int) -> EventShape | None:
    """The events' shape, or None when the model's KV is not one full-attention group (see the docstring)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) > 1:
        return None
    kind: str | None = "full_attention"
    window: int | None = None
    if groups:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

        spec = groups[0].kv_cache_spec
        kind = get_kv_cache_spec_kind(spec).value
        window = get_kv_cache_spec_sliding_window(spec)
        if kind not in ("full_attention", "mla_attention", "sink_full_attention"):
            return None
    return EventShape(block_size_tokens, chunk_size_tokens, 0, kind, window)


def chunk_blocks(shape: EventShape, request: Any, group: int, chunk: int) -> ChunkBlocks | None:
    """What the events of chunk ``chunk`` of ``request`` say; None when vLLM has not hashed all its blocks."""
    if group != shape.group_idx:
        return None
    block = shape.block_size_tokens
    per_chunk = shape.chunk_size_tokens // block
    first = chunk * per_chunk
    hashes = list(getattr(request, "block_hashes", None) or ())[first : first + per_chunk]
    start, end = chunk * shape.chunk_size_tokens, (chunk + 1) * shape.chunk_size_tokens
    tokens = list(request.all_token_ids[start:end])
    if len(hashes) != per_chunk or len(tokens) != shape.chunk_size_tokens:
        return None
    parent = maybe_convert_block_hash(request.block_hashes[first - 1]) if first > 0 else None
    extra: list[tuple[Any, ...] | None] = []
    for b in range(first, first + per_chunk):
        keys, _ = generate_block_hash_extra_keys(request, b * block, (b + 1) * block, 0)
        extra.append(keys)
    event_extra = to_event_extra_keys(extra) if any(k is not None for k in extra) else None
    lora = getattr(request, "lora_request", None)
    return ChunkBlocks(
        block_hashes=tuple(maybe_convert_block_hash(h) for h in hashes),
        parent_block_hash=parent,
        token_ids=tuple(int(t) for t in tokens),
        block_size=block,
        lora_name=getattr(lora, "lora_name", None) if lora is not None else None,
        lora_id=getattr(lora, "lora_int_id", None) if lora is not None else None,
        extra_keys=tuple(event_extra) if event_extra else None,
        group_idx=shape.group_idx,
        kv_cache_spec_kind=shape.kv_cache_spec_kind,
        kv_cache_spec_sliding_window=shape.kv_cache_spec_sliding_window,
    )


def to_vllm_events(changes: list[TierChange]) -> list[KVCacheEvent]:
    """The directory's changes as vLLM's own event objects, in order."""
    events: list[KVCacheEvent] = []
    for change in changes:
        if isinstance(change, StoredBlocks):
            blocks = change.blocks
            events.append(BlockStored(
                block_hashes=list(blocks.block_hashes),
                parent_block_hash=blocks.parent_block_hash,
                token_ids=list(blocks.token_ids),
                block_size=blocks.block_size,
                lora_id=blocks.lora_id,
                medium=change.medium,
                lora_name=blocks.lora_name,
                extra_keys=list(blocks.extra_keys) if blocks.extra_keys else None,
                group_idx=blocks.group_idx,
                kv_cache_spec_kind=blocks.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=blocks.kv_cache_spec_sliding_window,
                locality=LOCALITY,
            ))
        elif isinstance(change, RemovedBlocks):
            events.append(BlockRemoved(block_hashes=list(change.block_hashes), medium=change.medium,
                                       group_idx=change.group_idx, locality=LOCALITY))
    return events

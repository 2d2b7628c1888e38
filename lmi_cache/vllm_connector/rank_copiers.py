"""One rank's copiers between vLLM's paged KV cache and chunk payloads, built from its KV caches (vLLM worker process).

The attention layers alone define the KV layout (``transfer.layouts``: an
unknown one is refused at start-up). Without vLLM's hybrid KV cache manager,
or with one full-attention group, every layer is in one chunk, in vLLM's
order. Otherwise each KV cache group (full attention, sliding window) has its
own copier over its own layers; a state group (Mamba layers) has a
:class:`StateCopier` (one block's state of every layer as one uint8 payload).
A group that also holds DeepSeek-V3.2's indexer keys has a
:class:`MixedPagedCopier`: its chunks carry the latent's and the indexer's
blocks, each in its own layout, and the rank's layout tag names both.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lmi_cache.keys.kv_groups import KvCacheGroup, is_single_full_group
from lmi_cache.transfer.layouts import ExpectedGeometry, LayoutDescriptor, describe_kv_caches
from lmi_cache.transfer.mixed_copy import MixedPagedCopier
from lmi_cache.transfer.paged_copy import PagedChunkCopier
from lmi_cache.transfer.state_copy import StateCopier

PagedCopier = PagedChunkCopier | MixedPagedCopier


@dataclass
class RankCopiers:
    """The layout and the copiers of one rank, by KV cache group index."""

    layout: LayoutDescriptor
    paged: dict[int, PagedCopier]  # attention groups
    states: dict[int, StateCopier]  # state groups (Mamba layers)
    indexer_tag: str = ""  # the layout tag of both layouts when a group holds indexer keys


def build_rank_copiers(kv_caches: Mapping[str, torch.Tensor], geometry: ExpectedGeometry,
                       groups: tuple[KvCacheGroup, ...], blocks_per_chunk: int) -> RankCopiers:
    """``groups``: () or vLLM's KV cache groups (``keys.kv_groups``)."""
    state_groups = [g for g in groups if g.is_state]
    states = {g.index: StateCopier([kv_caches[name] for name in g.layer_names], g.state_shapes, g.state_dtypes)
              for g in state_groups}
    state_layers = {name for g in state_groups for name in g.layer_names}
    indexer_layers = {name for g in groups for name in g.indexer_layers}
    # State pages are raw bytes described by their group; DeepSeek-V3.2's indexer keys have a layout of their own.
    attention = {name: kv for name, kv in kv_caches.items() if name not in state_layers | indexer_layers}
    layout = describe_kv_caches(attention, geometry)
    if indexer_layers:
        return _mixed_copiers(kv_caches, layout, geometry, groups, blocks_per_chunk, states)
    if not groups or is_single_full_group(groups):
        paged: dict[int, PagedCopier] = {0: PagedChunkCopier(list(attention.values()), layout, blocks_per_chunk)}
    else:
        paged = {g.index: PagedChunkCopier([kv_caches[name] for name in g.layer_names], layout, blocks_per_chunk)
                 for g in groups if not g.is_state}
    return RankCopiers(layout, paged, states)


def _mixed_copiers(kv_caches: Mapping[str, torch.Tensor], layout: LayoutDescriptor, geometry: ExpectedGeometry,
                   groups: tuple[KvCacheGroup, ...], blocks_per_chunk: int,
                   states: dict[int, StateCopier]) -> RankCopiers:
    """Copiers when a group holds DeepSeek-V3.2's indexer keys: that group's chunks carry both layouts."""
    paged: dict[int, PagedCopier] = {}
    indexer_tag = ""
    for g in groups:
        latent = [kv_caches[name] for name in g.layer_names if name not in g.indexer_layers]
        if not g.indexer_layers:
            if not g.is_state:
                paged[g.index] = PagedChunkCopier(latent, layout, blocks_per_chunk)
            continue
        indexer_geometry = ExpectedGeometry(geometry.block_size_tokens, 1, g.indexer_head_size, is_mla=True)
        indexer = describe_kv_caches({name: kv_caches[name] for name in g.indexer_layers}, indexer_geometry)
        indexer_tag = "+indexer.".join(f"{d.tag}.{'x'.join(map(str, d.block_shape))}" for d in (layout, indexer))
        paged[g.index] = MixedPagedCopier(
            [(latent, layout), ([kv_caches[name] for name in g.indexer_layers], indexer)], blocks_per_chunk)
    return RankCopiers(layout, paged, states, indexer_tag)

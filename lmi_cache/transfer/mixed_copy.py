"""Whole blocks of a KV cache group whose layers differ in layout <-> one uint8 chunk payload (vLLM worker).

DeepSeek-V3.2 keeps, in one KV cache group with one block table, the MLA
latent of every layer (``[num_blocks, 1, N, 576]``, bf16 or float) and the
sparse-attention indexer's key cache of every layer (``[num_blocks, 1, N,
132]``, uint8). A chunk of such a group is one flat uint8 payload: each part
(the layers of one layout) gathered as a :class:`PagedChunkCopier` chunk
``[layers, blocks, *block_shape]`` in its own dtype, the parts one after the
other in the order given. Each part's bytes are copied whole-block by its own
copier, so a hit restores every layer byte for byte.

A payload of another size or dtype (another geometry) is refused with
``ChunkShapeError`` before any block is written; the worker turns it into a
miss. Groups of one layout keep the paged copier and its payloads unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmi_cache.transfer.layouts import LayoutDescriptor
from lmi_cache.transfer.paged_copy import ChunkShapeError, PagedChunkCopier


class _Events:
    """The copy-done events of every part (CUDA): done when all are."""

    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def query(self) -> bool:
        return all(event.query() for event in self._events)

    def synchronize(self) -> None:
        for event in self._events:
            event.synchronize()


class MixedPagedCopier:
    """Gather/scatter whole blocks of every layer of a group of several layouts, shaped like the paged copier."""

    dtype = torch.uint8

    def __init__(self, parts: Sequence[tuple[Sequence[torch.Tensor], LayoutDescriptor]], blocks_per_chunk: int) -> None:
        if len(parts) < 2:
            raise ValueError("MixedPagedCopier needs layers of at least two layouts")
        self._parts = [PagedChunkCopier(layers, layout, blocks_per_chunk) for layers, layout in parts]
        self._blocks_per_chunk = blocks_per_chunk

    @property
    def chunk_bytes(self) -> int:
        return sum(part.chunk_bytes for part in self._parts)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.chunk_bytes,)

    @property
    def overlaps_host_work(self) -> bool:
        return self._parts[0].overlaps_host_work

    def _split(self, payload: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Each part's chunk as a view of ``payload`` in that part's dtype and shape (no copy)."""
        if tuple(payload.shape) != self.chunk_shape or payload.dtype != self.dtype or not payload.is_contiguous():
            raise ChunkShapeError(f"{what} {list(payload.shape)} {payload.dtype} does not match "
                                  f"{list(self.chunk_shape)} {self.dtype}")
        views, offset = [], 0
        for part in self._parts:
            views.append(payload[offset:offset + part.chunk_bytes].view(part.dtype).view(part.chunk_shape))
            offset += part.chunk_bytes
        return views

    def gather_many(self, block_ids: Sequence[Sequence[int]], outs: Sequence[torch.Tensor]) -> None:
        """Full chunks (``block_ids[i]`` -> ``outs[i]``, uint8 payloads of ``chunk_shape``), one kernel call per part."""
        if len(block_ids) != len(outs):
            raise ValueError("gather_many: one output per chunk")
        views = [self._split(out, "gather target") for out in outs]
        for number, part in enumerate(self._parts):
            part.gather_many(block_ids, [view[number] for view in views])

    def scatter_many(
        self, chunks: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], block_offsets: Sequence[int]
    ) -> Any:
        """Payloads -> paged blocks of every part; every payload is checked before any block is written.

        Returns None when the copies are complete (CPU), else an event done when every part's copy is (CUDA).
        """
        if not (len(chunks) == len(block_ids) == len(block_offsets)):
            raise ValueError("scatter_many: one block list and offset per chunk")
        views = [self._split(chunk, "chunk buffer") for chunk in chunks]
        for ids, offset in zip(block_ids, block_offsets):
            if offset < 0 or offset + len(ids) > self._blocks_per_chunk:
                raise ChunkShapeError(f"blocks {offset}..{offset + len(ids)} outside a chunk of {self._blocks_per_chunk}")
        events = [part.scatter_many([view[number] for view in views], block_ids, block_offsets)
                  for number, part in enumerate(self._parts)]
        pending = [event for event in events if event is not None]
        return _Events(pending) if pending else None

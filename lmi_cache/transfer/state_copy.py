"""One request's Mamba / linear-attention state at a block boundary <-> one contiguous chunk payload (vLLM worker).

Hybrid models (Qwen3-Next, Granite 4 hybrid, Jamba, ...) keep, per state
layer, a few state tensors (a convolution window and a recurrent "SSM" state)
that vLLM binds as views over the KV cache pages of a Mamba KV cache group:
``MambaBase.bind_kv_cache`` gives each layer a tuple ``layer.kv_cache`` of
tensors shaped ``(num_blocks, *state_shape)``, one block per page, all states
of a layer packed at the start of the (padded) page. In prefix caching's
"align" mode block ``p`` of a request's Mamba block table holds the state
after exactly ``(p + 1) * block_size`` tokens; that block is what a cached
chunk boundary needs.

``gather_state`` copies one block of every state tensor of every layer of a
group into one contiguous uint8 payload (layer by layer, state by state, in
the group's layer order); ``scatter_state`` writes a payload back into one
block. Page padding and other blocks are never touched. Both are plain
torch copies, so device tensors take the same path (tested on CPU tensors
only); the payload lives where the caller allocates it. A payload from a different
geometry (layers, shapes or dtypes) is refused with ``StateShapeError``,
which the caller turns into a miss.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["StateCopier", "StateGeometry", "StateShapeError", "gather_state", "scatter_state", "state_views"]

LayerStates = Sequence[torch.Tensor]  # one layer's ``layer.kv_cache``: (num_blocks, *state_shape) per state


class StateShapeError(ValueError):
    """A state payload or block id does not fit this group's state geometry (treated as a miss)."""


@dataclass(frozen=True)
class StateGeometry:
    """What one block's state looks like for one group on one rank: per layer, per state, (shape, dtype)."""

    layers: tuple[tuple[tuple[tuple[int, ...], str], ...], ...]

    @classmethod
    def of(cls, group: Sequence[LayerStates]) -> "StateGeometry":
        return cls(tuple(tuple((tuple(state.shape[1:]), str(state.dtype).removeprefix("torch.")) for state in layer)
                         for layer in group))

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block's state over every layer: the state content, without vLLM's page padding."""
        return sum(math.prod(shape) * _itemsize(dtype) for layer in self.layers for shape, dtype in layer)

    @property
    def tag(self) -> str:
        """A stable text form for chunk keys: a change of geometry is a different key, never wrong state."""
        return ";".join(",".join(f"{dtype}{list(shape)}" for shape, dtype in layer) for layer in self.layers)


def state_views(pages: torch.Tensor, shapes: Sequence[Sequence[int]],
                dtypes: Sequence[torch.dtype]) -> tuple[torch.Tensor, ...]:
    """One layer's state views from the page view the connector's ``register_kv_caches`` receives for it.

    vLLM hands a Mamba layer's cache as a ``[num_blocks, 1, 1, page_content_bytes]`` int8 view; the layer's
    ``MambaSpec`` names its state shapes and dtypes. The states are packed from the start of each page in
    that order, as ``MambaBase.bind_kv_cache`` slices them, so these views alias the layer's own.
    """
    # squeeze, not reshape: a reshape could copy, and writes to a copy would never reach the cache.
    flat = pages.squeeze(dim=(1, 2)) if pages.dim() == 4 else pages
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in zip(shapes, dtypes)]
    if flat.dim() != 2 or flat.dtype != torch.int8 or sum(sizes) > flat.shape[1]:
        raise StateShapeError(f"states of {sum(sizes):,} bytes do not fit pages {tuple(pages.shape)} {pages.dtype}")
    views, offset = [], 0
    for shape, dtype, nbytes in zip(shapes, dtypes, sizes):
        views.append(flat[:, offset:offset + nbytes].view(dtype).view(-1, *shape))
        offset += nbytes
    return tuple(views)


class StateCopier:
    """One state group's layers on one rank, from the page views ``register_kv_caches`` receives for them.

    Shaped like the paged copier where the worker saves (``chunk_shape``, ``dtype``, ``chunk_bytes``,
    ``gather_many``): a chunk of a state group is one block's state, a uint8 payload.
    """

    dtype = torch.uint8

    def __init__(self, pages: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], dtype_names: Sequence[str]):
        dtypes = [getattr(torch, name) for name in dtype_names]
        self.layers = [state_views(layer_pages, shapes, dtypes) for layer_pages in pages]
        self.geometry = StateGeometry.of(self.layers)

    @property
    def chunk_bytes(self) -> int:
        return self.geometry.payload_bytes

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.geometry.payload_bytes,)

    def gather_many(self, block_ids: Sequence[Sequence[int]], outs: Sequence[torch.Tensor]) -> None:
        """The state of block ``block_ids[i][0]`` (one block per state chunk) into ``outs[i]``."""
        for ids, out in zip(block_ids, outs, strict=True):
            gather_state(self.layers, ids[0], out)

    def scatter(self, block_id: int, payload: torch.Tensor) -> None:
        scatter_state(self.layers, block_id, payload)


def gather_state(group: Sequence[LayerStates], block_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy block ``block_id`` of every state of every layer into one contiguous uint8 payload (``out`` if given)."""
    geometry = StateGeometry.of(group)
    _check_block(group, block_id)
    payload = out if out is not None else torch.empty(geometry.payload_bytes, dtype=torch.uint8,
                                                      device=_device(group))
    _check_payload(payload, geometry)
    for block, part in _pairs(group, block_id, payload):
        part.copy_(block)
    return payload


def scatter_state(group: Sequence[LayerStates], block_id: int, payload: torch.Tensor) -> None:
    """Write a ``gather_state`` payload into block ``block_id`` of every state of every layer of the group."""
    geometry = StateGeometry.of(group)
    _check_block(group, block_id)
    _check_payload(payload, geometry)
    for block, part in _pairs(group, block_id, payload):
        block.copy_(part)


def _pairs(group: Sequence[LayerStates], block_id: int,
           payload: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(one state's block, the payload's bytes for it viewed in the state's dtype and shape), in payload order."""
    offset = 0
    for layer in group:
        for state in layer:
            block = state[block_id]
            nbytes = block.numel() * block.element_size()
            # A typed view of the payload: each copy is one strided copy, no temporary.
            yield block, payload[offset:offset + nbytes].view(state.dtype).view(block.shape)
            offset += nbytes


def _check_block(group: Sequence[LayerStates], block_id: int) -> None:
    if not group or not all(group):
        raise StateShapeError("a state group needs at least one layer with at least one state tensor")
    num_blocks = min(state.shape[0] for layer in group for state in layer)
    # Block 0 is vLLM's null block: never a request's state.
    if not 0 < block_id < num_blocks:
        raise StateShapeError(f"block id {block_id} is outside this group's blocks 1..{num_blocks - 1}")


def _check_payload(payload: torch.Tensor, geometry: StateGeometry) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise StateShapeError(f"a state payload is a contiguous 1-D uint8 tensor, got {payload.dtype} "
                              f"{tuple(payload.shape)}")
    if payload.numel() != geometry.payload_bytes:
        raise StateShapeError(f"state payload of {payload.numel():,} bytes, this group's state is "
                              f"{geometry.payload_bytes:,} bytes ({geometry.tag})")


def _device(group: Sequence[LayerStates]) -> torch.device:
    return group[0][0].device


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()

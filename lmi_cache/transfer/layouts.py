"""Recognise the paged KV-cache tensor layout vLLM hands a worker (vLLM worker process).

vLLM's attention backends lay their per-layer KV tensors out differently, and
the layout changes between releases. Copying raw blocks of one layout into a
cache read by another silently corrupts attention, so the worker identifies the
layout once, at ``register_kv_caches``, and refuses anything it does not know.

Each known layout is described by where the block dimension is and what one
block of one layer looks like once that dimension is moved to the front. The
descriptor's ``tag`` (layout kind + physical stride order + dtype) goes into the
chunk-key namespace so chunks written under one layout are never read under
another. Shapes we recognise (per layer; H = KV heads on this rank, N = block
size in tokens, D = head size, L = MLA latent size):

==================  ===============================  ==========
kind                logical shape                    block dim
==================  ===============================  ==========
``cpu``             [num_blocks, H, N, 2*D]          0   (vLLM CPU, "LBHNC")
``flash_nhd``       [2, num_blocks, N, H, D]         1   (flash-attn, NHD)
``flash_hnd``       [2, num_blocks, H, N, D]         1   (flash-attn, HND)
``flashinfer_nhd``  [num_blocks, 2, N, H, D]         0
``flashinfer_hnd``  [num_blocks, 2, H, N, D]         0
``mla``             [num_blocks, N, L]               0
``mla``             [num_blocks, 1, N, L]            0   (vLLM 0.32's MLA views: one head slot)
==================  ===============================  ==========

vLLM also expresses HND by permuting strides under an NHD logical shape; the
stride order is part of the tag, so that case is distinguished too. Copies go
through logical indexing, so they are correct for any stride order.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lmi_cache.errors import UserError


class KvLayoutError(UserError):
    """vLLM gave the worker KV tensors whose layout we do not recognise."""


@dataclass(frozen=True)
class ExpectedGeometry:
    """What the model config says one rank's KV cache must look like."""

    block_size_tokens: int
    num_kv_heads: int  # on this rank
    head_size: int  # per head; for MLA the latent size
    is_mla: bool = False


@dataclass(frozen=True)
class LayoutDescriptor:
    """How to find block ``i`` of one layer's KV tensor."""

    kind: str
    block_dim: int
    num_blocks: int
    block_shape: tuple[int, ...]  # one block of one layer, block dim removed
    dtype: torch.dtype
    stride_order: tuple[int, ...]  # dims from outermost to innermost in memory

    @property
    def tag(self) -> str:
        order = "".join(str(d) for d in self.stride_order)
        dtype_name = str(self.dtype).removeprefix("torch.")
        return f"{self.kind}.s{order}.{dtype_name}"

    @property
    def block_numel(self) -> int:
        numel = 1
        for size in self.block_shape:
            numel *= size
        return numel

    def block_view(self, layer: torch.Tensor) -> torch.Tensor:
        """A view of ``layer`` with the block dimension first (no copy)."""
        return layer if self.block_dim == 0 else layer.movedim(self.block_dim, 0)


def _stride_order(tensor: torch.Tensor) -> tuple[int, ...]:
    # Ties (size-1 dims) are broken by dim index so the order is deterministic.
    strides = tensor.stride()
    return tuple(sorted(range(tensor.dim()), key=lambda d: (-int(strides[d]), d)))


def _candidate_shapes(geo: ExpectedGeometry, num_blocks: int) -> list[tuple[str, int, tuple[int, ...]]]:
    n, h, d = geo.block_size_tokens, geo.num_kv_heads, geo.head_size
    if geo.is_mla:
        # vLLM 0.32 views an MLA layer's pages as [blocks, 1 head slot, N, L] (MLAAttentionSpec: num_kv_heads 1).
        return [("mla", 0, (num_blocks, n, d)), ("mla", 0, (num_blocks, 1, n, d))]
    return [
        ("cpu", 0, (num_blocks, h, n, 2 * d)),
        ("flash_nhd", 1, (2, num_blocks, n, h, d)),
        ("flash_hnd", 1, (2, num_blocks, h, n, d)),
        ("flashinfer_nhd", 0, (num_blocks, 2, n, h, d)),
        ("flashinfer_hnd", 0, (num_blocks, 2, h, n, d)),
    ]


def _num_blocks_guess(shape: tuple[int, ...]) -> list[int]:
    # The block count is the first or second dimension in every known layout.
    return sorted({shape[0], shape[1]} if len(shape) >= 2 else set())


def describe_layer(tensor: torch.Tensor, geo: ExpectedGeometry, layer_name: str = "?") -> LayoutDescriptor:
    """Recognise one layer's KV tensor or raise :class:`KvLayoutError`."""
    shape = tuple(tensor.shape)
    matches: list[tuple[str, int, tuple[int, ...]]] = []
    for num_blocks in _num_blocks_guess(shape):
        for kind, block_dim, expected in _candidate_shapes(geo, num_blocks):
            if expected == shape and all(m[0] != kind for m in matches):
                matches.append((kind, block_dim, expected))
    if not matches:
        raise KvLayoutError(
            f"KV cache layer {layer_name}: unknown layout shape {list(shape)} for block_size="
            f"{geo.block_size_tokens}, kv_heads={geo.num_kv_heads}, head_size={geo.head_size}"
            f"{', mla' if geo.is_mla else ''}; refusing to start rather than corrupt the cache "
            "(use the vLLM version lmi-cache pins, or disable the connector)"
        )
    if len(matches) > 1:
        kinds = ", ".join(m[0] for m in matches)
        raise KvLayoutError(
            f"KV cache layer {layer_name}: shape {list(shape)} is ambiguous between layouts "
            f"({kinds}); refusing to start (disable the connector for this model geometry)"
        )
    kind, block_dim, expected = matches[0]
    block_shape = tuple(s for i, s in enumerate(expected) if i != block_dim)
    return LayoutDescriptor(
        kind=kind,
        block_dim=block_dim,
        num_blocks=expected[block_dim],
        block_shape=block_shape,
        dtype=tensor.dtype,
        stride_order=_stride_order(tensor),
    )


def describe_kv_caches(kv_caches: Mapping[str, torch.Tensor], geo: ExpectedGeometry) -> LayoutDescriptor:
    """Recognise all layers; they must share one layout (no hybrid models)."""
    if not kv_caches:
        raise KvLayoutError("KV cache registration: vLLM registered no KV cache layers; nothing to offload")
    first: LayoutDescriptor | None = None
    for name, tensor in kv_caches.items():
        desc = describe_layer(tensor, geo, name)
        if first is None:
            first = desc
        elif desc != first:
            raise KvLayoutError(
                f"KV cache layer {name}: layout {desc.tag} {list(tensor.shape)} differs from the first "
                f"layer's {first.tag}; hybrid KV layouts are not supported (disable the connector)"
            )
    assert first is not None
    return first

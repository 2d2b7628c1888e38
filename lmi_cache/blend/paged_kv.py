"""Token-granular reads and writes of per-layer K/V in vLLM's paged KV cache (vLLM worker process).

Blending needs what whole-block copies (``transfer.paged_copy``) do not give:
the K and V of individual tokens, split apart, in the blender's
``[T, kv_heads, head_dim]`` shape, at positions that need not start or end on
a block boundary. A token at prompt position ``p`` lives in block
``block_ids[p // N]`` at offset ``p % N``.

Layouts (``transfer.layouts`` names them; one block with the block dim first):

- ``cpu`` [H, N, 2*D]: per (block, head), K transposed ([D, N]) then V
  ([N, D]); not K and V side by side per token (checked against the K/V
  vLLM writes, in the e2e tests).
- ``flash_nhd`` / ``flash_hnd``: [2, nb, N, H, D] / [2, nb, H, N, D].
- ``flashinfer_nhd`` / ``flashinfer_hnd``: [nb, 2, N, H, D] / [nb, 2, H, N, D].

MLA caches hold no per-head K/V and are refused.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from lmi_cache.transfer.layouts import LayoutDescriptor

SUPPORTED_KINDS = ("cpu", "flash_nhd", "flash_hnd", "flashinfer_nhd", "flashinfer_hnd")


class PagedKV:
    """Per-layer token K/V access over one rank's registered KV tensors."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: LayoutDescriptor, block_size_tokens: int) -> None:
        if layout.kind not in SUPPORTED_KINDS:
            raise ValueError(f"blending cannot read KV layout {layout.kind!r} (supported: {', '.join(SUPPORTED_KINDS)})")
        self.layout = layout
        self.block_size = block_size_tokens
        self._k: list[torch.Tensor] = []  # per layer: [num_blocks, N, H, D] views (no copy)
        self._v: list[torch.Tensor] = []
        for layer in layers:
            k, v = _kv_views(layer, layout.kind, block_size_tokens)
            self._k.append(k)
            self._v.append(v)

    @property
    def num_layers(self) -> int:
        return len(self._k)

    def _slots(self, block_ids: Sequence[int], start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end)
        blocks = torch.as_tensor(list(block_ids), dtype=torch.long)[positions // self.block_size]
        return blocks.to(device), (positions % self.block_size).to(device)

    def read(self, block_ids: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of prompt tokens [start, end): two [layers, T, H, D] tensors (copies)."""
        if end > len(block_ids) * self.block_size:
            raise ValueError(f"tokens up to {end} need {-(-end // self.block_size)} blocks, got {len(block_ids)}")
        blocks, offsets = self._slots(block_ids, start, end, self._k[0].device)
        k = torch.stack([layer[blocks, offsets] for layer in self._k])
        v = torch.stack([layer[blocks, offsets] for layer in self._v])
        return k, v

    def write(self, block_ids: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write [layers, T, H, D] K and V as prompt tokens [start, start + T)."""
        end = start + int(k.shape[1])
        if end > len(block_ids) * self.block_size:
            raise ValueError(f"tokens up to {end} need {-(-end // self.block_size)} blocks, got {len(block_ids)}")
        if k.shape[0] != self.num_layers:
            raise ValueError(f"KV for {k.shape[0]} layers, the cache has {self.num_layers}")
        blocks, offsets = self._slots(block_ids, start, end, self._k[0].device)
        for layer in range(self.num_layers):
            target_k, target_v = self._k[layer], self._v[layer]
            target_k[blocks, offsets] = k[layer].to(device=target_k.device, dtype=target_k.dtype)
            target_v[blocks, offsets] = v[layer].to(device=target_v.device, dtype=target_v.dtype)


def _kv_views(layer: torch.Tensor, kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_blocks, N, H, D] views of one layer's K and V (indexing them writes the cache)."""
    if kind == "cpu":
        nb, h, _, two_d = layer.shape
        d = two_d // 2
        # Per (block, head): N*D values of K stored transposed ([D, N]: the kernel's dot products
        # read one dim of every token), then N*D values of V as [N, D]. Measured on vLLM 0.32 CPU.
        flat = layer.view(nb, h, 2 * n * d)
        k = flat[:, :, : n * d].view(nb, h, d, n).permute(0, 3, 1, 2)
        v = flat[:, :, n * d :].view(nb, h, n, d).transpose(1, 2)
        return k, v
    if kind == "flash_nhd":
        return layer[0], layer[1]
    if kind == "flash_hnd":
        return layer[0].transpose(1, 2), layer[1].transpose(1, 2)
    if kind == "flashinfer_nhd":
        return layer[:, 0], layer[:, 1]
    if kind == "flashinfer_hnd":
        return layer[:, 0].transpose(1, 2), layer[:, 1].transpose(1, 2)
    raise ValueError(f"unknown KV layout kind {kind!r}")

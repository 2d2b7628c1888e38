"""Transfer-handler seam: paged KV blocks <-> contiguous chunk buffers (vLLM worker process).

The worker side of the connector decides nothing about policy; it asks a
``TransferHandler`` to cut the blocks of one chunk out of vLLM's paged cache
into one contiguous host tensor (what the engine stores) and to write such a
tensor back into given blocks. Concrete handlers live in sibling modules.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class TransferHandler(ABC):
    """Moves whole blocks of every layer between the paged cache and chunk buffers."""

    @property
    @abstractmethod
    def chunk_shape(self) -> tuple[int, ...]:
        """Shape of one full chunk buffer: ``[num_layers, blocks_per_chunk, *block_shape]``."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """Element type of chunk buffers (the KV cache dtype)."""

    @abstractmethod
    def gather_chunk(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy the blocks of one full chunk into a host tensor of ``chunk_shape``.

        The returned tensor may be a reused staging buffer: callers must copy it
        (the engine's ``store`` does) before the next gather.
        """

    @abstractmethod
    def scatter_chunk(self, chunk: torch.Tensor, block_ids: Sequence[int], block_offset: int = 0) -> None:
        """Write chunk blocks ``block_offset .. block_offset+len(block_ids)`` into ``block_ids``."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for copies issued on side streams (no-op on CPU)."""

"""What one entry of the placement directory weighs, per rank and KV cache group (vLLM scheduler process).

An entry's payload is ``num_tokens`` x the per-token bytes of its KV cache
group on its rank. The scheduler never sees a tensor, so each worker reports
its full chunk's payload bytes once with its layout (``set_chunk_bytes``);
the directory reserves that much in a tier's budget before the chunk is
written.
"""
from __future__ import annotations


class ChunkSizes:
    """Payload bytes of a full chunk of each (rank, KV cache group), as the workers reported them."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self._chunk_bytes: dict[tuple[int, int], int] = {}  # (rank, group) -> payload bytes of a full chunk

    def set_chunk_bytes(self, rank: int, group: int, payload_bytes: int) -> None:
        self._chunk_bytes[(rank, group)] = payload_bytes

    def payload_bytes(self, rank: int, group: int, num_tokens: int) -> int:
        """Payload bytes of ``num_tokens`` of a group's KV on a rank, rounded up (integers: a full chunk is exactly
        the size the worker reported, so the tiers, which count the same, never find more than was reserved)."""
        chunk = self._chunk_bytes.get((rank, group))
        if chunk is None:  # an unreported group: the largest size known (over-reserving is safe)
            chunk = max(self._chunk_bytes.values(), default=0)
        return -(-chunk * num_tokens // self.chunk_tokens)

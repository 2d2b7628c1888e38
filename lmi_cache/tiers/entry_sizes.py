"""What one chunk takes of each local tier's budget (both processes: the directory budgets with these, the tiers
account with them).

The one place the tiers' rounding lives: the CPU tier keeps an allocator buffer
of the chunk's size class (``tiers.buffers.size_class_bytes``), the disk tier a
file, rounded up to its write alignment (``object_files.round_up``) when it
writes with O_DIRECT. The
placement directory (scheduler) reserves exactly these sizes and the tiers
(workers) count exactly these sizes, so a tier holding what the directory
planned never finds itself over its budget.
"""
from __future__ import annotations

from lmi_cache.keys.chunk_format import HEADER_BYTES
from lmi_cache.tiers.buffers import size_class_bytes
from lmi_cache.tiers.disk.object_files import round_up


def cpu_entry_bytes(payload_bytes: int) -> int:
    """Budget bytes of a chunk in the CPU tier: its allocator size class (header included)."""
    return size_class_bytes(HEADER_BYTES + payload_bytes)


def disk_entry_bytes(payload_bytes: int, odirect: bool = True) -> int:
    """Budget bytes of a chunk in the disk tier: its file, rounded up to the write alignment when written with
    O_DIRECT (``use_odirect``; a directory that falls back to buffered writes then takes less than reserved)."""
    return round_up(HEADER_BYTES + payload_bytes) if odirect else HEADER_BYTES + payload_bytes

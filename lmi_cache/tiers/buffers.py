"""Byte-buffer helpers of the host allocator and the tiers: size classes, dtypes (worker process)."""
from __future__ import annotations

import torch

PAGE_BYTES = 4096  # buffers start page-aligned so O_DIRECT can write them without a copy


def size_class_bytes(num_bytes: int) -> int:
    """Round up to 1/64 of the power of two below (<= 1.6% waste; chunk objects are
    usually 2**k + header bytes, the worst case for coarser classes)."""
    if num_bytes <= PAGE_BYTES:
        return PAGE_BYTES
    step = max(PAGE_BYTES, (1 << (num_bytes.bit_length() - 1)) // 64)
    return -(-num_bytes // step) * step


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""Byte-buffer helpers of the CPU tier and the engine: size classes, dtypes, copies (worker process)."""
from __future__ import annotations

import threading

import numpy as np
import torch

from lmi_cache.chunk_format import HEADER_BYTES, ChunkHeader

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


def copy_payload_out(obj: torch.Tensor, header: ChunkHeader, out: torch.Tensor | None = None) -> torch.Tensor:
    """The object's payload as a new tensor (or copied into ``out``) of the stored dtype/shape."""
    payload = obj[HEADER_BYTES : header.total_bytes]
    dtype = torch_dtype(header.dtype)
    if out is not None:
        if out.dtype != dtype or out.numel() * out.element_size() != header.payload_bytes or not out.is_contiguous():
            raise ValueError("out tensor does not match the stored chunk's dtype and size")
        copy_bytes(out.reshape(-1).view(torch.uint8), payload)
        return out
    result = torch.empty(header.shape, dtype=dtype)
    copy_bytes(result.reshape(-1).view(torch.uint8), payload)
    return result


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for uint8 tensors, blocking.

    On the caller's main thread (vLLM's worker loop, between forward passes)
    torch's copy uses the intra-op thread pool: measured 2x numpy's memcpy on
    an idle 2-core host. From other threads (disk workers, parallel reads)
    numpy's single-threaded memcpy (it drops the GIL): there torch's OpenMP
    copy contends with the main thread's pool and measured up to 20x slower
    on a busy host. Blocking on purpose: the source entry may be unpinned and
    recycled right after.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu" and threading.current_thread() is not _MAIN_THREAD:
        np.copyto(dst.detach().numpy(), src.detach().numpy())
    else:
        dst.copy_(src)


_MAIN_THREAD = threading.main_thread()

"""Paged KV blocks <-> contiguous chunk buffers, device-agnostic torch (vLLM worker process).

A chunk buffer holds every layer's blocks of one chunk on this rank:
``[num_layers, blocks_per_chunk, *block_shape]``, contiguous, on the host. The
engine stores and returns such tensors; this module moves them in and out of
vLLM's paged cache with one ``kernels.gather``/``kernels.scatter`` call per
chunk or per batch of chunks (all layers at once; native or torch backend).

CPU (vLLM CPU backend, tested in CI): gathers write straight into a reused host
staging buffer or the caller's memory, scatters read straight from the
engine's tensor.

CUDA: gathers run on a side stream that first waits for the compute stream,
land in a device staging buffer and are copied to a pinned host buffer; the
side stream is synchronised before the host buffer is handed to the engine.
Loads copy host -> device on a side stream and make the compute stream wait on
an event, so the CPU never blocks on a load. The stream calls go through
``StreamOps``: CI (no GPU) runs this same path with CPU tensors and a
recording fake; the real ``torch.cuda`` behaviour is assumed, not tested.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from lmi_cache.transfer import kernels
from lmi_cache.transfer.base import TransferHandler
from lmi_cache.transfer.layouts import LayoutDescriptor


class ChunkShapeError(ValueError):
    """A chunk buffer does not match this rank's chunk geometry (treated as a miss)."""


class StreamOps(Protocol):
    """The few stream/event operations the side-stream path needs (torch.cuda's shape)."""

    def new_stream(self, device: torch.device) -> Any: ...

    def current_stream(self, device: torch.device) -> Any: ...

    def use(self, stream: Any) -> AbstractContextManager[Any]: ...

    def new_event(self) -> Any: ...


class CudaStreamOps:
    """``StreamOps`` backed by ``torch.cuda`` (used when the KV cache lives on a CUDA device)."""

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()


class PagedChunkCopier(TransferHandler):
    """Gather/scatter whole blocks of all layers of one rank."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        layout: LayoutDescriptor,
        blocks_per_chunk: int,
        stream_ops: StreamOps | None = None,
    ) -> None:
        if not layers:
            raise ValueError("PagedChunkCopier needs at least one KV layer")
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        self._layout = layout
        self.backend = kernels.backend()  # resolves LMI_CACHE_KERNELS now: a bad choice fails at start-up
        self._views = [layout.block_view(layer) for layer in layers]
        self._device = layers[0].device
        self._blocks_per_chunk = blocks_per_chunk
        self._chunk_shape = (len(layers), blocks_per_chunk, *layout.block_shape)
        if stream_ops is None and self._device.type == "cuda":
            stream_ops = CudaStreamOps()
        self._streams = stream_ops
        # Pinned host memory makes device <-> host copies asynchronous (CUDA only).
        pin = self._device.type == "cuda"
        self._host_staging = torch.empty(self._chunk_shape, dtype=layout.dtype, pin_memory=pin)
        self._device_staging: torch.Tensor | None = None
        self._device_load_staging: torch.Tensor | None = None
        self._save_stream: Any = None
        self._load_stream: Any = None
        if self._streams is not None:
            self._device_staging = torch.empty(self._chunk_shape, dtype=layout.dtype, device=self._device)
            self._device_load_staging = torch.empty(self._chunk_shape, dtype=layout.dtype, device=self._device)
            self._save_stream = self._streams.new_stream(self._device)
            self._load_stream = self._streams.new_stream(self._device)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return self._chunk_shape

    @property
    def dtype(self) -> torch.dtype:
        return self._layout.dtype

    @property
    def chunk_bytes(self) -> int:
        return self._host_staging.numel() * self._host_staging.element_size()

    @staticmethod
    def _table(block_ids: Sequence[int], block_offset: int = 0, chunk_index: int = 0) -> torch.Tensor:
        # Rows (chunk index, slot in chunk, paged block id): the kernels' table (always on the host).
        rows = [(chunk_index, block_offset + i, int(b)) for i, b in enumerate(block_ids)]
        return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)

    def gather_chunk(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """All layers' blocks of one chunk as one host tensor of ``chunk_shape``.

        With ``out`` (a host tensor of ``chunk_shape``/``dtype``, e.g. engine
        memory) the blocks land there; otherwise in a reused staging buffer
        that the next call overwrites.
        """
        if len(block_ids) != self._blocks_per_chunk:
            raise ChunkShapeError(f"a full chunk has {self._blocks_per_chunk} blocks, got {len(block_ids)}")
        host = self._host_staging if out is None else out
        if tuple(host.shape) != self._chunk_shape or host.dtype != self._layout.dtype:
            raise ChunkShapeError(
                f"gather target {list(host.shape)} {host.dtype} does not match "
                f"{list(self._chunk_shape)} {self._layout.dtype}"
            )
        table = self._table(block_ids)
        if self._streams is None:
            kernels.gather(self._views, table, [host])
            return host
        assert self._device_staging is not None
        # The side stream must see this step's attention writes before reading blocks.
        self._save_stream.wait_stream(self._streams.current_stream(self._device))
        with self._streams.use(self._save_stream):
            kernels.gather(self._views, table, [self._device_staging])
            host.copy_(self._device_staging, non_blocking=True)
        self._save_stream.synchronize()
        return host

    def reusable_host_buffer(self) -> torch.Tensor | None:
        """A host buffer that loads may reuse chunk after chunk, or None on CUDA.

        On the CPU the scatter is synchronous, so one warm buffer serves every
        load (a fresh 4 MiB tensor per chunk costs ~1,000 page faults). On CUDA
        the host-to-device copy is asynchronous and may still be reading it.
        """
        return self._host_staging if self._streams is None else None

    def scatter_chunk(self, chunk: torch.Tensor, block_ids: Sequence[int], block_offset: int = 0) -> None:
        if tuple(chunk.shape) != self._chunk_shape or chunk.dtype != self._layout.dtype:
            raise ChunkShapeError(
                f"chunk buffer {list(chunk.shape)} {chunk.dtype} does not match "
                f"{list(self._chunk_shape)} {self._layout.dtype}"
            )
        num = len(block_ids)
        if num == 0:
            return
        if block_offset < 0 or block_offset + num > self._blocks_per_chunk:
            raise ChunkShapeError(f"blocks {block_offset}..{block_offset + num} outside a chunk of {self._blocks_per_chunk}")
        table = self._table(block_ids, block_offset)
        if self._streams is None:
            # The native kernels read contiguous buffers; engines hand out contiguous ones, so this rarely copies.
            kernels.scatter(self._views, table, [chunk.contiguous()])
            return
        assert self._device_load_staging is not None
        compute = self._streams.current_stream(self._device)
        # Blocks were zeroed on the compute stream; the load must land after that.
        self._load_stream.wait_stream(compute)
        with self._streams.use(self._load_stream):
            # Only the blocks that load travel; copies on this one stream run in order,
            # so the next load cannot overwrite the staging buffer before this scatter read it.
            part = slice(block_offset, block_offset + num)
            self._device_load_staging[:, part].copy_(chunk[:, part], non_blocking=True)
            kernels.scatter(self._views, table, [self._device_load_staging])
            done = self._streams.new_event()
            done.record(self._load_stream)
        # The forward pass (on the compute stream) waits on the GPU, not the CPU.
        compute.wait_event(done)

    def synchronize(self) -> None:
        # Waits for the side streams only: the engine's host tensors must outlive their
        # (possibly pinned, truly asynchronous) copies; the compute stream is not waited on.
        if self._streams is not None:
            self._load_stream.synchronize()
            self._save_stream.synchronize()

"""Paged KV blocks <-> contiguous chunk buffers, device-agnostic torch (vLLM worker process).

A chunk buffer holds every layer's blocks of one chunk on this rank:
``[num_layers, blocks_per_chunk, *block_shape]``, contiguous, on the host. The
engine stores and returns such tensors; this module moves them in and out of
vLLM's paged cache with one ``kernels.gather``/``kernels.scatter`` call per
batch of chunks (``gather_many``/``scatter_many``: all layers of all chunks
of a step at once; native or torch backend).

CPU (vLLM CPU backend, tested in CI): gathers write straight into the engine's
host buffers, scatters read straight from them (a CPU-tier hit is copied once,
tier buffer -> paged cache).

CUDA: gathers run on a side stream that first waits for the compute stream,
land in a device staging buffer and are copied to page-locked host buffers;
the side stream is synchronised before the host buffers are handed to the
engine. Loads copy page-locked host buffers -> device asynchronously on a
side stream and make the compute stream wait on an event, so the CPU never
blocks on a load: ``scatter_many`` returns that event, and the caller keeps
the host buffers alive until it has completed. The stream calls go through
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

    def gather_many(self, block_ids: Sequence[Sequence[int]], outs: Sequence[torch.Tensor]) -> None:
        """Full chunks (``block_ids[i]`` -> ``outs[i]``, host tensors of ``chunk_shape``) in one kernel call."""
        if len(block_ids) != len(outs):
            raise ValueError("gather_many: one output per chunk")
        if not outs:
            return
        for ids, host in zip(block_ids, outs):
            if len(ids) != self._blocks_per_chunk:
                raise ChunkShapeError(f"a full chunk has {self._blocks_per_chunk} blocks, got {len(ids)}")
            self._check_chunk(host, "gather target")
        table = torch.cat([self._table(ids, 0, number) for number, ids in enumerate(block_ids)])
        if self._streams is None:
            kernels.gather(self._views, table, list(outs))
            return
        staging = self._staging("_device_staging_many", len(outs))
        self._save_stream.wait_stream(self._streams.current_stream(self._device))
        with self._streams.use(self._save_stream):
            kernels.gather(self._views, table, list(staging))
            for number, host in enumerate(outs):
                host.copy_(staging[number], non_blocking=True)
        self._save_stream.synchronize()  # the engine reads the host buffers right after

    @property
    def overlaps_host_work(self) -> bool:
        """Whether a copy returns before it is done (CUDA streams), so it can overlap reads still in flight.

        On the CPU backend a copy is a parallel region on vLLM's OpenMP threads, one per core:
        started while disk or network reads are running it waits for the cores they hold.
        """
        return self._streams is not None

    def scatter_many(
        self, chunks: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], block_offsets: Sequence[int]
    ) -> Any:
        """Chunks -> paged blocks in one kernel call; ``chunks[i]`` fills ``block_ids[i]`` from slot
        ``block_offsets[i]``. Returns None when the copy is complete (CPU), else an event that completes
        when the host buffers may be reused (CUDA)."""
        if not (len(chunks) == len(block_ids) == len(block_offsets)):
            raise ValueError("scatter_many: one block list and offset per chunk")
        rows = []
        for number, (chunk, ids, offset) in enumerate(zip(chunks, block_ids, block_offsets)):
            self._check_chunk(chunk, "chunk buffer")
            if offset < 0 or offset + len(ids) > self._blocks_per_chunk:
                raise ChunkShapeError(f"blocks {offset}..{offset + len(ids)} outside a chunk of {self._blocks_per_chunk}")
            if ids:
                rows.append(self._table(ids, offset, number))
        if not rows:
            return None
        table = torch.cat(rows)
        if self._streams is None:
            kernels.scatter(self._views, table, [chunk.contiguous() for chunk in chunks])
            return None
        staging = self._staging("_device_load_staging_many", len(chunks))
        compute = self._streams.current_stream(self._device)
        self._load_stream.wait_stream(compute)  # blocks were zeroed on the compute stream
        with self._streams.use(self._load_stream):
            for number, (chunk, ids, offset) in enumerate(zip(chunks, block_ids, block_offsets)):
                part = slice(offset, offset + len(ids))  # only the blocks that load travel
                staging[number][:, part].copy_(chunk[:, part], non_blocking=True)
            kernels.scatter(self._views, table, list(staging[: len(chunks)]))
            done = self._streams.new_event()
            done.record(self._load_stream)
        compute.wait_event(done)  # the forward pass waits on the GPU, not the CPU
        return done

    def _check_chunk(self, chunk: torch.Tensor, what: str) -> None:
        if tuple(chunk.shape) != self._chunk_shape or chunk.dtype != self._layout.dtype:
            raise ChunkShapeError(
                f"{what} {list(chunk.shape)} {chunk.dtype} does not match {list(self._chunk_shape)} {self._layout.dtype}"
            )

    def _staging(self, name: str, count: int) -> torch.Tensor:
        """A device buffer of at least ``count`` chunks, grown on demand and kept (CUDA only)."""
        current: torch.Tensor | None = getattr(self, name, None)
        if current is None or current.size(0) < count:
            current = torch.empty((count, *self._chunk_shape), dtype=self._layout.dtype, device=self._device)
            setattr(self, name, current)
        return current

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

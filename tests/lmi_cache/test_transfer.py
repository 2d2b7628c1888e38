"""Paged gather/scatter: chunk buffers round-trip exactly for every layout (CPU tensors)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.transfer.layouts import ExpectedGeometry, describe_kv_caches
from lmi_cache.transfer.paged_copy import ChunkShapeError, PagedChunkCopier

GEO = ExpectedGeometry(block_size_tokens=4, num_kv_heads=2, head_size=3)
NUM_BLOCKS = 12
NUM_LAYERS = 3
SHAPES = {
    "cpu": (NUM_BLOCKS, 2, 4, 6),
    "flash_nhd": (2, NUM_BLOCKS, 4, 2, 3),
    "flash_hnd": (2, NUM_BLOCKS, 2, 4, 3),
    "flashinfer_nhd": (NUM_BLOCKS, 2, 4, 2, 3),
    "flashinfer_hnd": (NUM_BLOCKS, 2, 2, 4, 3),
}


def make_layers(kind: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # One allocation viewed per layer, as vLLM does.
    whole = torch.randn((NUM_LAYERS, *SHAPES[kind]), generator=gen)
    return [whole[i] for i in range(NUM_LAYERS)]


def block_of(layer: torch.Tensor, kind: str, block_id: int) -> torch.Tensor:
    return layer[:, block_id] if kind.startswith("flash_") else layer[block_id]


def copier_for(layers: list[torch.Tensor], blocks_per_chunk: int) -> PagedChunkCopier:
    desc = describe_kv_caches({f"l{i}": t for i, t in enumerate(layers)}, GEO)
    return PagedChunkCopier(layers, desc, blocks_per_chunk)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(sorted(SHAPES)),
    ids=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=3, max_size=3, unique=True),
    dst=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=3, max_size=3, unique=True),
    seed=st.integers(0, 1000),
)
def test_gather_then_scatter_moves_exact_blocks(kind: str, ids: list[int], dst: list[int], seed: int) -> None:
    src_layers = make_layers(kind, seed)
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    copier = copier_for(src_layers, 3)
    chunk = copier.gather_chunk(ids).clone()
    assert tuple(chunk.shape) == copier.chunk_shape and chunk.is_contiguous()
    copier_for(dst_layers, 3).scatter_chunk(chunk, dst)
    for layer_idx in range(NUM_LAYERS):
        for src_id, dst_id in zip(ids, dst):
            assert torch.equal(block_of(dst_layers[layer_idx], kind, dst_id), block_of(src_layers[layer_idx], kind, src_id))
    touched = set(dst)
    for layer in dst_layers:
        for b in range(NUM_BLOCKS):
            if b not in touched:
                assert not block_of(layer, kind, b).any()


def test_partial_scatter_writes_only_requested_blocks() -> None:
    src = make_layers("cpu", 1)
    copier = copier_for(src, 4)
    chunk = copier.gather_chunk([0, 1, 2, 3]).clone()
    dst = [torch.zeros_like(t) for t in src]
    copier_for(dst, 4).scatter_chunk(chunk, [7, 8], block_offset=2)
    assert torch.equal(dst[1][7], src[1][2]) and torch.equal(dst[1][8], src[1][3])
    assert not dst[1][:7].any() and not dst[1][9:].any()


def test_gather_buffer_is_reused_so_callers_must_copy() -> None:
    src = make_layers("cpu", 2)
    copier = copier_for(src, 2)
    first = copier.gather_chunk([0, 1])
    snapshot = first.clone()
    second = copier.gather_chunk([2, 3])
    assert second.data_ptr() == first.data_ptr()
    assert not torch.equal(snapshot, second)


def test_wrong_chunk_shape_or_dtype_is_rejected() -> None:
    src = make_layers("cpu", 3)
    copier = copier_for(src, 2)
    with pytest.raises(ChunkShapeError):
        copier.scatter_chunk(torch.zeros(NUM_LAYERS, 3, 2, 4, 6), [0, 1])
    with pytest.raises(ChunkShapeError):
        copier.scatter_chunk(torch.zeros(copier.chunk_shape, dtype=torch.float16), [0, 1])
    with pytest.raises(ChunkShapeError):
        copier.scatter_chunk(torch.zeros(copier.chunk_shape), [0, 1], block_offset=1)
    with pytest.raises(ChunkShapeError):
        copier.gather_chunk([0])


def test_chunk_bytes() -> None:
    copier = copier_for(make_layers("cpu", 4), 2)
    assert copier.chunk_bytes == NUM_LAYERS * 2 * 2 * 4 * 6 * 4


class RecordingStreams:
    """CPU stand-in for torch.cuda streams/events: runs the side-stream path and logs its order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.num_streams = 0
        self.compute = self._stream("compute")

    def _stream(self, name: str) -> Any:
        log = self.log

        class Stream:
            def wait_stream(self, other: Any) -> None:
                log.append(f"{name}.wait_stream({other.name})")

            def wait_event(self, event: Any) -> None:
                log.append(f"{name}.wait_event")

            def synchronize(self) -> None:
                log.append(f"{name}.synchronize")

        stream = Stream()
        stream.name = name  # type: ignore[attr-defined]
        return stream

    def new_stream(self, device: torch.device) -> Any:
        # Per copier: side0 = save stream, side1 = load stream.
        stream = self._stream(f"side{self.num_streams % 2}")
        self.num_streams += 1
        return stream

    def current_stream(self, device: torch.device) -> Any:
        return self.compute

    def use(self, stream: Any) -> Any:
        log = self.log

        class Ctx:
            def __enter__(self) -> None:
                log.append(f"enter {stream.name}")

            def __exit__(self, *exc: object) -> None:
                log.append(f"exit {stream.name}")

        return Ctx()

    def new_event(self) -> Any:
        log = self.log

        class Event:
            def record(self, stream: Any) -> None:
                log.append(f"record on {stream.name}")

        return Event()


def test_side_stream_path_moves_the_same_bytes_in_the_right_order() -> None:
    src = make_layers("flash_hnd", 5)
    desc = describe_kv_caches({f"l{i}": t for i, t in enumerate(src)}, GEO)
    streams = RecordingStreams()
    copier = PagedChunkCopier(src, desc, 2, stream_ops=streams)
    assert copier.reusable_host_buffer() is None  # async H2D copies may still read a host buffer
    chunk = copier.gather_chunk([4, 9]).clone()
    assert streams.log[:2] == ["side0.wait_stream(compute)", "enter side0"]
    assert streams.log[-1] == "side0.synchronize"  # host buffer complete before the engine sees it
    reference = copier_for(src, 2).gather_chunk([4, 9])
    assert torch.equal(chunk, reference)
    streams.log.clear()
    dst = [torch.zeros_like(t) for t in src]
    PagedChunkCopier(dst, desc, 2, stream_ops=streams).scatter_chunk(chunk, [1], block_offset=1)
    assert streams.log == [
        "side1.wait_stream(compute)", "enter side1", "record on side1", "exit side1", "compute.wait_event"
    ]
    assert torch.equal(dst[0][:, 1], src[0][:, 9]) and not dst[0][:, 0].any()


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_gather_into_caller_memory_matches_staging_gather(kind: str) -> None:
    layers = make_layers(kind, 7)
    copier = copier_for(layers, 2)
    expected = copier.gather_chunk([5, 1]).clone()
    out = torch.full(copier.chunk_shape, float("nan"), dtype=copier.dtype)
    assert copier.gather_chunk([5, 1], out) is out
    assert torch.equal(out, expected)
    with pytest.raises(ChunkShapeError):
        copier.gather_chunk([5, 1], torch.empty(copier.chunk_shape, dtype=torch.float16))


def test_reusable_host_buffer_only_without_async_streams() -> None:
    layers = make_layers("cpu", 3)
    copier = copier_for(layers, 2)
    buf = copier.reusable_host_buffer()
    assert buf is not None and tuple(buf.shape) == copier.chunk_shape
    # Loading two different chunks through the same buffer still lands each one exactly.
    first = copier.gather_chunk([0, 1]).clone()
    second = copier.gather_chunk([2, 3]).clone()
    buf.copy_(first)
    copier.scatter_chunk(buf, [4, 5])
    buf.copy_(second)
    copier.scatter_chunk(buf, [6, 7])
    assert torch.equal(copier.gather_chunk([4, 5]), first) and torch.equal(copier.gather_chunk([6, 7]), second)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here; scripts/gpu_check.sh runs this on a GPU")
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_cuda_copier_moves_exact_blocks_through_side_streams(kind: str) -> None:
    src_cpu = make_layers(kind, 11)
    src = [t.cuda() for t in src_cpu]
    desc = describe_kv_caches({f"l{i}": t for i, t in enumerate(src)}, GEO)
    copier = PagedChunkCopier(src, desc, 3)  # real torch.cuda streams and events
    chunk = copier.gather_chunk([5, 0, 9]).clone()
    assert chunk.device.type == "cpu"
    assert torch.equal(chunk, copier_for(src_cpu, 3).gather_chunk([5, 0, 9]))
    dst = [torch.zeros_like(t) for t in src]
    loader = PagedChunkCopier(dst, desc, 3)
    loader.scatter_chunk(chunk, [2, 7], block_offset=1)
    loader.synchronize()
    torch.cuda.current_stream().synchronize()  # the forward pass would wait on the load event
    for layer_idx in range(NUM_LAYERS):
        assert torch.equal(block_of(dst[layer_idx], kind, 2), block_of(src[layer_idx], kind, 0))
        assert torch.equal(block_of(dst[layer_idx], kind, 7), block_of(src[layer_idx], kind, 9))
        assert int(block_of(dst[layer_idx], kind, 5).abs().sum()) == 0


def test_scatter_accepts_a_non_contiguous_chunk_buffer() -> None:
    src = make_layers("flash_nhd", 12)
    copier = copier_for(src, 2)
    chunk = copier.gather_chunk([3, 8]).clone()
    strided = chunk.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not strided.is_contiguous()
    dst = [torch.zeros_like(t) for t in src]
    copier_for(dst, 2).scatter_chunk(strided, [0, 1])
    assert torch.equal(block_of(dst[2], "flash_nhd", 0), block_of(src[2], "flash_nhd", 3))
    assert torch.equal(block_of(dst[2], "flash_nhd", 1), block_of(src[2], "flash_nhd", 8))

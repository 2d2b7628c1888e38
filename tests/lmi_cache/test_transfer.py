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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here; scripts/gpu_check.sh runs this on a GPU")
def test_cuda_batched_copies_from_page_locked_memory() -> None:
    src_cpu = make_layers("flash_nhd", 13)
    src = [t.cuda() for t in src_cpu]
    desc = describe_kv_caches({f"l{i}": t for i, t in enumerate(src)}, GEO)
    copier = PagedChunkCopier(src, desc, 2)
    outs = [torch.empty(copier.chunk_shape, pin_memory=True) for _ in range(3)]  # as the host allocator gives
    copier.gather_many([[1, 2], [7, 3], [11, 0]], outs)
    reference = copier_for(src_cpu, 2)
    assert all(torch.equal(o, reference.gather_chunk(ids)) for o, ids in zip(outs, ([1, 2], [7, 3], [11, 0])))
    dst = [torch.zeros_like(t) for t in src]
    event = PagedChunkCopier(dst, desc, 2).scatter_many(outs, [[4, 5], [6], [8, 9]], [0, 1, 0])
    assert event is not None
    event.synchronize()  # what the worker waits for before it releases the host buffers
    torch.cuda.current_stream().synchronize()
    for layer in range(NUM_LAYERS):
        assert torch.equal(dst[layer][:, 4], src[layer][:, 1]) and torch.equal(dst[layer][:, 6], src[layer][:, 3])
        assert torch.equal(dst[layer][:, 9], src[layer][:, 0])


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


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(sorted(SHAPES)),
    chunks=st.lists(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=2, max_size=2), min_size=1, max_size=4),
    offsets=st.lists(st.integers(0, 1), min_size=4, max_size=4),
    seed=st.integers(0, 1000),
)
def test_batched_gather_and_scatter_equal_one_chunk_at_a_time(
    kind: str, chunks: list[list[int]], offsets: list[int], seed: int
) -> None:
    src = make_layers(kind, seed)
    copier = copier_for(src, 2)
    outs = [torch.empty(copier.chunk_shape) for _ in chunks]
    copier.gather_many(chunks, outs)  # one kernel call for every chunk
    for ids, out in zip(chunks, outs):
        assert torch.equal(out, copier.gather_chunk(ids))
    batched = [torch.zeros_like(t) for t in src]
    one_by_one = [torch.zeros_like(t) for t in src]
    targets = [[(7 + 2 * i) % NUM_BLOCKS, (8 + 2 * i) % NUM_BLOCKS][offsets[i]:] for i in range(len(chunks))]
    offs = offsets[: len(chunks)]
    assert copier_for(batched, 2).scatter_many(outs, targets, offs) is None  # CPU: complete on return
    single = copier_for(one_by_one, 2)
    for out, ids, off in zip(outs, targets, offs):
        single.scatter_chunk(out, ids, off)
    assert all(torch.equal(a, b) for a, b in zip(batched, one_by_one))


def test_batched_scatter_rejects_a_wrong_chunk_and_offsets() -> None:
    copier = copier_for(make_layers("cpu", 1), 2)
    good = torch.zeros(copier.chunk_shape)
    with pytest.raises(ChunkShapeError):
        copier.scatter_many([good, torch.zeros(3)], [[1], [2]], [0, 0])
    with pytest.raises(ChunkShapeError):
        copier.scatter_many([good], [[1, 2]], [1])  # two blocks from slot 1 overflow a 2-block chunk
    with pytest.raises(ValueError):
        copier.scatter_many([good], [[1], [2]], [0])


def test_side_stream_batched_scatter_returns_the_event_the_compute_stream_waits_on() -> None:
    src = make_layers("flash_hnd", 3)
    desc = describe_kv_caches({f"l{i}": t for i, t in enumerate(src)}, GEO)
    chunks = [copier_for(src, 2).gather_chunk(ids).clone() for ids in ([1, 2], [5, 6])]
    streams = RecordingStreams()
    dst = [torch.zeros_like(t) for t in src]
    event = PagedChunkCopier(dst, desc, 2, stream_ops=streams).scatter_many(chunks, [[3, 4], [9]], [0, 1])
    assert event is not None  # the caller keeps the host buffers until it completes
    assert streams.log == [
        "side1.wait_stream(compute)", "enter side1", "record on side1", "exit side1", "compute.wait_event"
    ]
    assert all(torch.equal(d[:, 3], s[:, 1]) and torch.equal(d[:, 9], s[:, 6]) for d, s in zip(dst, src))

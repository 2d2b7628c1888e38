"""Paged gather/scatter kernels: native, torch and the CUDA kernel body (run on the host) agree byte for byte.

Every case is checked against a plain Python reference (rows applied in
order, so a later row writing the same destination wins), for all layouts the
connector accepts, HND expressed by stride permutation, 8/16/32-bit KV,
partial chunks and repeated, out-of-order block ids.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.transfer import kernels

DTYPES = [torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float16, torch.bfloat16, torch.float32]
# name: (physical shape per layer, permutation to the logical shape, block dim of the logical shape)
# with nb = num_blocks, n = block size, h = heads, d = head size (MLA: d = latent size).
LAYOUTS = {
    "cpu": (lambda nb, n, h, d: (nb, h, n, 2 * d), (0, 1, 2, 3), 0),
    "flash_nhd": (lambda nb, n, h, d: (2, nb, n, h, d), (0, 1, 2, 3, 4), 1),
    "flash_hnd": (lambda nb, n, h, d: (2, nb, h, n, d), (0, 1, 2, 3, 4), 1),
    "flash_hnd_by_strides": (lambda nb, n, h, d: (2, nb, h, n, d), (0, 1, 3, 2, 4), 1),
    "flashinfer_nhd": (lambda nb, n, h, d: (nb, 2, n, h, d), (0, 1, 2, 3, 4), 0),
    "flashinfer_hnd": (lambda nb, n, h, d: (nb, 2, h, n, d), (0, 1, 2, 3, 4), 0),
    "flashinfer_hnd_by_strides": (lambda nb, n, h, d: (nb, 2, h, n, d), (0, 1, 3, 2, 4), 0),
    "mla": (lambda nb, n, h, d: (nb, n, d), (0, 1, 2), 0),
    "mla_head_slot": (lambda nb, n, h, d: (nb, 1, n, d), (0, 1, 2, 3), 0),  # vLLM 0.32's MLA views
}


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def make_layers(kind: str, num_layers: int, geo: tuple[int, int, int, int], dtype: torch.dtype,
                gen: torch.Generator, device: str = "cpu") -> list[torch.Tensor]:
    """Block-first views of per-layer KV tensors, all views of one allocation (as vLLM does)."""
    physical, perm, block_dim = LAYOUTS[kind]
    whole = random_bytes((num_layers, *physical(*geo)), dtype, gen).to(device)
    return [whole[i].permute(perm).movedim(block_dim, 0) for i in range(num_layers)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def reference(layers: list[torch.Tensor], rows: list[tuple[int, int, int]], chunks: list[torch.Tensor],
              to_paged: bool) -> None:
    for c, slot, block in rows:
        for layer_idx, layer in enumerate(layers):
            if to_paged:
                layer[block] = chunks[c][layer_idx, slot]
            else:
                chunks[c][layer_idx, slot] = layer[block]


def _copy_with(impl: str, layers: list[torch.Tensor], table: torch.Tensor, chunks: list[torch.Tensor],
               to_paged: bool) -> None:
    if impl == "emulated_cuda":
        # The raw extension refuses duplicate destinations; kernels' last-wins rule applies first.
        ext = kernels.load_extension()
        deduped = kernels.drop_overwritten(table, to_paged)
        (ext.scatter_emulated if to_paged else ext.gather_emulated)(layers, deduped, chunks, 7)
    else:
        (kernels.scatter if to_paged else kernels.gather)(layers, table, chunks, via=impl)


@st.composite
def cases(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(sorted(LAYOUTS)))
    num_blocks = draw(st.integers(1, 9))
    geo = (num_blocks, draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 20)))
    num_chunks = draw(st.integers(1, 3))
    blocks_per_chunk = draw(st.integers(1, 4))
    row = st.tuples(st.integers(0, num_chunks - 1), st.integers(0, blocks_per_chunk - 1), st.integers(0, num_blocks - 1))
    return {
        "kind": kind,
        "geo": geo,
        "dtype": draw(st.sampled_from(DTYPES)),
        "num_layers": draw(st.integers(1, 3)),
        "num_chunks": num_chunks,
        "blocks_per_chunk": blocks_per_chunk,
        "rows": draw(st.lists(row, min_size=0, max_size=10)),
        "seed": draw(st.integers(0, 2**31)),
    }


IMPLS = ["native", "torch", "emulated_cuda"]
CUDA = torch.cuda.is_available()


def check_case(case: dict, device: str, impls: list[str]) -> None:
    """Run gather and scatter of ``case`` through each impl on ``device``; compare with the CPU reference."""
    def fresh() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(case["seed"])
        layers = make_layers(case["kind"], case["num_layers"], case["geo"], case["dtype"], gen, device)
        chunk_shape = (case["num_layers"], case["blocks_per_chunk"], *layers[0].shape[1:])
        return layers, [random_bytes(chunk_shape, case["dtype"], gen).to(device) for _ in range(case["num_chunks"])]

    table = torch.tensor(case["rows"], dtype=torch.long).reshape(-1, 3)
    layers0, chunks0 = fresh()
    layers_cpu, chunks_cpu = [t.cpu() for t in layers0], [c.cpu() for c in chunks0]
    expected_chunks = [c.clone() for c in chunks_cpu]
    reference(layers_cpu, case["rows"], expected_chunks, to_paged=False)
    expected_layers = [t.clone() for t in layers_cpu]
    reference(expected_layers, case["rows"], chunks_cpu, to_paged=True)
    for impl in impls:
        layers, chunks = fresh()
        _copy_with(impl, layers, table, chunks, to_paged=False)
        for got, want in zip(chunks, expected_chunks):
            assert torch.equal(as_bytes(got.cpu()), as_bytes(want)), f"gather via {impl} on {device}"
        layers, chunks = fresh()
        _copy_with(impl, layers, table, chunks, to_paged=True)
        for got, want in zip(layers, expected_layers):
            assert torch.equal(as_bytes(got.cpu()), as_bytes(want)), f"scatter via {impl} on {device}"


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_gather_and_scatter_match_the_reference_byte_for_byte(case: dict) -> None:
    check_case(case, "cpu", IMPLS)


@pytest.mark.skipif(not CUDA, reason="no CUDA device here; scripts/gpu_check.sh runs this on a GPU machine")
@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_cuda_kernels_match_the_reference_byte_for_byte(case: dict) -> None:
    check_case(case, "cuda", ["native", "torch"])


@pytest.mark.parametrize("via", IMPLS)
def test_whole_chunks_round_trip_on_a_vllm_sized_cpu_cache(via: str) -> None:
    # 7M-model geometry: 4 layers, 2 KV heads, block 128, head 32, bf16; 3 chunks of 2 blocks.
    gen = torch.Generator().manual_seed(3)
    layers = make_layers("cpu", 4, (40, 128, 2, 32), torch.bfloat16, gen)
    table = torch.tensor([(c, s, b) for c, (s, b) in [(0, (0, 7)), (0, (1, 3)), (1, (0, 30)), (1, (1, 31)),
                                                      (2, (1, 0)), (2, (0, 39))]], dtype=torch.long)
    chunks = [torch.empty((4, 2, 2, 128, 64), dtype=torch.bfloat16) for _ in range(3)]
    _copy_with(via, layers, table, chunks, to_paged=False)
    assert torch.equal(as_bytes(chunks[0][2, 1]), as_bytes(layers[2][3]))
    assert torch.equal(as_bytes(chunks[2][3, 0]), as_bytes(layers[3][39]))
    dst = [torch.zeros_like(t) for t in layers]
    _copy_with(via, dst, table, chunks, to_paged=True)
    for t_src, t_dst in zip(layers, dst):
        for b in (7, 3, 30, 31, 0, 39):
            assert torch.equal(as_bytes(t_dst[b]), as_bytes(t_src[b]))
        assert not as_bytes(t_dst[1]).any()


@pytest.mark.parametrize("via", ["native", "torch"])
def test_out_of_range_block_id_raises_and_writes_nothing(via: str) -> None:
    layers = make_layers("flash_nhd", 2, (4, 2, 2, 4), torch.float32, torch.Generator().manual_seed(1))
    chunk = torch.zeros((2, 2, *layers[0].shape[1:]))
    before = [t.clone() for t in layers]
    with pytest.raises((RuntimeError, IndexError)):
        kernels.scatter(layers, torch.tensor([[0, 0, 1], [0, 1, 4]]), [chunk], via=via)
    if via == "native":  # validated before any byte moves
        assert all(torch.equal(a, b) for a, b in zip(layers, before))
    with pytest.raises((RuntimeError, IndexError)):
        kernels.gather(layers, torch.tensor([[0, 0, -1]]), [chunk], via=via)


def test_native_refuses_mismatched_buffers_and_duplicate_destinations() -> None:
    ext = kernels.load_extension()
    layers = make_layers("cpu", 2, (4, 2, 2, 4), torch.float32, torch.Generator().manual_seed(2))
    good = torch.zeros((2, 2, *layers[0].shape[1:]))
    with pytest.raises(RuntimeError, match="shape"):
        ext.gather(layers, torch.tensor([[0, 0, 1]]), [torch.zeros((3, 2, *layers[0].shape[1:]))])
    with pytest.raises(RuntimeError, match="dtype"):
        ext.gather(layers, torch.tensor([[0, 0, 1]]), [good.half()])
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.gather(layers, torch.tensor([[0, 0, 1]]), [good.transpose(0, 1).contiguous().transpose(0, 1)])
    with pytest.raises(RuntimeError, match="earlier row"):
        ext.scatter(layers, torch.tensor([[0, 0, 1], [0, 1, 1]]), [good])
    # Through kernels the later row wins instead.
    good[:, 1] = 5.0
    kernels.scatter(layers, torch.tensor([[0, 0, 1], [0, 1, 1]]), [good], via="native")
    assert bool((layers[0][1] == 5.0).all())

"""Layout recognition: every known vLLM KV layout is identified; unknown ones are refused."""
from __future__ import annotations

import pytest
import torch

from lmi_cache.errors import UserError
from lmi_cache.transfer.layouts import ExpectedGeometry, KvLayoutError, describe_kv_caches, describe_layer

GEO = ExpectedGeometry(block_size_tokens=16, num_kv_heads=2, head_size=8)
NB = 5


@pytest.mark.parametrize(
    ("shape", "kind", "block_dim"),
    [
        ((NB, 2, 16, 16), "cpu", 0),
        ((2, NB, 16, 2, 8), "flash_nhd", 1),
        ((2, NB, 2, 16, 8), "flash_hnd", 1),
        ((NB, 2, 16, 2, 8), "flashinfer_nhd", 0),
        ((NB, 2, 2, 16, 8), "flashinfer_hnd", 0),
    ],
)
def test_known_layouts_are_recognised(shape: tuple[int, ...], kind: str, block_dim: int) -> None:
    desc = describe_layer(torch.zeros(shape), GEO)
    assert desc.kind == kind
    assert desc.block_dim == block_dim
    assert desc.num_blocks == NB
    assert desc.block_view(torch.zeros(shape)).shape[0] == NB


def test_mla_layout() -> None:
    geo = ExpectedGeometry(block_size_tokens=16, num_kv_heads=1, head_size=576, is_mla=True)
    desc = describe_layer(torch.zeros(NB, 16, 576, dtype=torch.bfloat16), geo)
    assert desc.kind == "mla" and desc.block_shape == (16, 576)
    assert desc.tag.endswith("bfloat16")
    # vLLM 0.32 registers MLA layers with a head-slot dimension of 1 (measured on its CPU backend).
    vllm_032 = describe_layer(torch.zeros(NB, 1, 16, 576, dtype=torch.bfloat16), geo)
    assert vllm_032.kind == "mla" and vllm_032.block_shape == (1, 16, 576) and vllm_032.tag != desc.tag


def test_stride_permuted_hnd_gets_a_different_tag() -> None:
    nhd = torch.zeros(2, NB, 16, 2, 8)
    # vLLM's HND for flash-attn: physical [2, NB, H, N, D], logical NHD view.
    hnd_physical = torch.zeros(2, NB, 2, 16, 8).permute(0, 1, 3, 2, 4)
    assert hnd_physical.shape == nhd.shape
    a, b = describe_layer(nhd, GEO), describe_layer(hnd_physical, GEO)
    assert a.kind == b.kind == "flash_nhd"
    assert a.tag != b.tag


def test_dtype_is_part_of_the_tag() -> None:
    a = describe_layer(torch.zeros(NB, 2, 16, 16, dtype=torch.float32), GEO)
    b = describe_layer(torch.zeros(NB, 2, 16, 16, dtype=torch.float16), GEO)
    assert a.tag != b.tag


@pytest.mark.parametrize("shape", [(NB, 2, 16, 8), (NB, 16, 2, 16), (2, NB, 16, 2, 9), (NB * 16, 2, 8)])
def test_unknown_layout_is_refused_with_one_line(shape: tuple[int, ...]) -> None:
    with pytest.raises(KvLayoutError) as err:
        describe_layer(torch.zeros(shape), GEO, "model.layers.0.self_attn.attn")
    assert isinstance(err.value, UserError)
    msg = str(err.value)
    assert "\n" not in msg and "model.layers.0.self_attn.attn" in msg and "unknown layout" in msg


def test_mixed_layers_are_refused() -> None:
    caches = {"a": torch.zeros(NB, 2, 16, 16), "b": torch.zeros(NB, 2, 16, 2, 8)}
    with pytest.raises(KvLayoutError, match="differs"):
        describe_kv_caches(caches, GEO)


def test_no_layers_refused() -> None:
    with pytest.raises(KvLayoutError):
        describe_kv_caches({}, GEO)


def test_ambiguous_shape_refused() -> None:
    # With 2 blocks, [2, 2, N, H, D] is both flash (2 = K/V) and flashinfer (2 = blocks).
    with pytest.raises(KvLayoutError, match="ambiguous"):
        describe_layer(torch.zeros(2, 2, 16, 2, 8), GEO)

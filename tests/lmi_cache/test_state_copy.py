"""Gathering and scattering one block of Mamba state (lmi_cache.transfer.state_copy), on CPU tensors, vLLM-free.

The state views are built the way vLLM's ``MambaBase.bind_kv_cache`` builds
them (test_state_copy_vllm.py uses vLLM's own code): per layer, each state
is a strided view ``(num_blocks, *shape)`` over one padded page per block,
the states packed at the start of the page.
"""
from __future__ import annotations

import math

import pytest

from lmi_cache.transfer.state_copy import StateGeometry, StateShapeError, gather_state, scatter_state, state_views

torch = pytest.importorskip("torch")

SHAPES = ((3, 544), (8, 64, 16))  # a Mamba2 layer: conv window, SSM state
PAGE_BYTES = 65_536  # padded to the attention page, as vLLM does
NUM_BLOCKS = 6


def bound_layers(raw: "torch.Tensor", num_layers: int, dtypes: tuple["torch.dtype", ...]) -> list[list["torch.Tensor"]]:
    """Per layer, the state views of a layer-outermost int8 buffer of padded pages."""
    layers = []
    for layer in range(num_layers):
        pages = raw[layer * NUM_BLOCKS * PAGE_BYTES:(layer + 1) * NUM_BLOCKS * PAGE_BYTES].view(NUM_BLOCKS, PAGE_BYTES)
        states, offset = [], 0
        for shape, dtype in zip(SHAPES, dtypes):
            nbytes = math.prod(shape) * dtype.itemsize
            states.append(pages[:, offset:offset + nbytes].view(dtype).view(-1, *shape))
            offset += nbytes
        layers.append(states)
    return layers


def same_bits(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    """Bitwise equality: random bytes read as floats include NaNs, which torch.equal calls unequal."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def filled(num_layers: int = 2, dtypes: tuple["torch.dtype", ...] = (torch.float32, torch.float32),
           seed: int = 0) -> tuple["torch.Tensor", list[list["torch.Tensor"]]]:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 127, (num_layers * NUM_BLOCKS * PAGE_BYTES,), dtype=torch.int8, generator=gen)
    return raw, bound_layers(raw, num_layers, dtypes)


def test_round_trip_moves_one_block_and_nothing_else() -> None:
    src_raw, src = filled(seed=1)
    dst_raw, dst = filled(seed=2)
    before = dst_raw.clone()
    payload = gather_state(src, 4)
    assert payload.dtype == torch.uint8 and payload.numel() == 2 * (3 * 544 + 8 * 64 * 16) * 4
    scatter_state(dst, 2, payload)
    for s_layer, d_layer in zip(src, dst):
        for s_state, d_state in zip(s_layer, d_layer):
            assert same_bits(d_state[2], s_state[4])
    # Every byte outside block 2's state content (other blocks, the page padding) is unchanged.
    changed = (dst_raw != before).nonzero().flatten()
    content = 3 * 544 * 4 + 8 * 64 * 16 * 4
    for layer in range(2):
        start = layer * NUM_BLOCKS * PAGE_BYTES + 2 * PAGE_BYTES
        inside = (changed >= start) & (changed < start + content)
        changed = changed[~inside]
    assert changed.numel() == 0


def test_payload_is_layer_by_layer_state_by_state() -> None:
    _, group = filled()
    payload = gather_state(group, 1)
    conv_bytes = 3 * 544 * 4
    assert same_bits(payload[:conv_bytes].view(torch.float32).view(3, 544), group[0][0][1])
    layer_bytes = conv_bytes + 8 * 64 * 16 * 4
    assert same_bits(payload[layer_bytes:layer_bytes + conv_bytes].view(torch.float32).view(3, 544),
                     group[1][0][1])


def test_gather_into_a_given_buffer() -> None:
    _, group = filled()
    out = torch.zeros(StateGeometry.of(group).payload_bytes, dtype=torch.uint8)
    assert gather_state(group, 3, out) is out
    assert torch.equal(out, gather_state(group, 3))


def test_mixed_dtypes_keep_their_bits() -> None:
    _, src = filled(dtypes=(torch.bfloat16, torch.float32), seed=3)
    _, dst = filled(dtypes=(torch.bfloat16, torch.float32), seed=4)
    scatter_state(dst, 5, gather_state(src, 1))
    assert same_bits(dst[1][0][5], src[1][0][1]) and same_bits(dst[1][1][5], src[1][1][1])


def test_geometry_names_layers_shapes_and_dtypes() -> None:
    _, f32 = filled()
    _, bf16 = filled(dtypes=(torch.bfloat16, torch.float32))
    assert StateGeometry.of(f32).tag == "float32[3, 544],float32[8, 64, 16];float32[3, 544],float32[8, 64, 16]"
    assert StateGeometry.of(f32).tag != StateGeometry.of(bf16).tag
    assert StateGeometry.of(f32[:1]).payload_bytes * 2 == StateGeometry.of(f32).payload_bytes


@pytest.mark.parametrize("block_id", [0, NUM_BLOCKS, -1])
def test_null_and_out_of_range_blocks_are_refused(block_id: int) -> None:
    _, group = filled()
    with pytest.raises(StateShapeError, match="block id"):
        gather_state(group, block_id)


def test_a_payload_of_another_geometry_is_refused_and_writes_nothing() -> None:
    _, other = filled(num_layers=1)
    dst_raw, dst = filled()
    before = dst_raw.clone()
    with pytest.raises(StateShapeError, match="state payload of"):
        scatter_state(dst, 2, gather_state(other, 1))
    with pytest.raises(StateShapeError, match="uint8"):
        scatter_state(dst, 2, torch.zeros(StateGeometry.of(dst).payload_bytes // 4, dtype=torch.float32))
    assert torch.equal(dst_raw, before)


def test_state_views_refuse_pages_too_small_for_the_states() -> None:
    pages = torch.zeros(NUM_BLOCKS, 1, 1, 1024, dtype=torch.int8)
    with pytest.raises(StateShapeError, match="do not fit"):
        state_views(pages, SHAPES, (torch.float32, torch.float32))


def test_state_views_write_through_to_the_pages() -> None:
    pages = torch.zeros(NUM_BLOCKS, 1, 1, PAGE_BYTES, dtype=torch.int8)
    conv, ssm = state_views(pages, SHAPES, (torch.float32, torch.float32))
    ssm[2].fill_(1.0)
    offset = 3 * 544 * 4
    assert torch.equal(pages[2, 0, 0, offset:offset + 4].view(torch.float32), torch.ones(1))
    assert pages[1].abs().sum() == 0 and conv.abs().sum() == 0

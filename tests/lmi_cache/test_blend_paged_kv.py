"""PagedKV: token-granular K/V reads and writes in vLLM's paged layouts (CPU tensors).

The CPU layout's K-transposed-per-block placement is checked against what vLLM
itself writes in the e2e blend tests; here the views are checked for round trips,
block boundaries and the byte placement that finding established.
"""
from __future__ import annotations

import pytest
import torch

from lmi_cache.blend.paged_kv import PagedKV
from lmi_cache.transfer.layouts import ExpectedGeometry, describe_kv_caches

N, H, D, BLOCKS, LAYERS = 16, 2, 8, 12, 3


def _paged(kind_shape: tuple[int, ...]) -> tuple[PagedKV, list[torch.Tensor]]:
    layers = [torch.zeros(kind_shape) for _ in range(LAYERS)]
    layout = describe_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)},
                                ExpectedGeometry(block_size_tokens=N, num_kv_heads=H, head_size=D))
    return PagedKV(layers, layout, N), layers


@pytest.mark.parametrize("shape", [(BLOCKS, H, N, 2 * D), (2, BLOCKS, N, H, D), (2, BLOCKS, H, N, D),
                                   (BLOCKS, 2, N, H, D)])
def test_write_then_read_round_trips_across_block_boundaries(shape: tuple[int, ...]) -> None:
    paged, _ = _paged(shape)
    block_ids = [7, 2, 9, 4]
    k, v = torch.randn(LAYERS, 40, H, D), torch.randn(LAYERS, 40, H, D)
    paged.write(block_ids, 5, k, v)  # tokens 5..44: three block boundaries
    got_k, got_v = paged.read(block_ids, 5, 45)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    before_k, _ = paged.read(block_ids, 0, 5)
    assert not before_k.any()  # nothing written outside the span


def test_cpu_layout_places_k_transposed_then_v_per_block_and_head() -> None:
    paged, layers = _paged((BLOCKS, H, N, 2 * D))
    k, v = torch.randn(LAYERS, 1, H, D), torch.randn(LAYERS, 1, H, D)
    paged.write([3], 5, k, v)  # token offset 5 of block 3
    flat = layers[1][3].reshape(H, 2 * N * D)
    for head in range(H):
        k_t = flat[head, : N * D].view(D, N)  # [D, N]: one dim of every token per row
        v_rows = flat[head, N * D :].view(N, D)
        assert torch.equal(k_t[:, 5], k[1, 0, head])
        assert torch.equal(v_rows[5], v[1, 0, head])


def test_out_of_range_tokens_are_refused() -> None:
    paged, _ = _paged((BLOCKS, H, N, 2 * D))
    with pytest.raises(ValueError, match="blocks"):
        paged.read([1], 0, N + 1)
    with pytest.raises(ValueError, match="layers"):
        paged.write([1, 2], 0, torch.zeros(LAYERS + 1, 4, H, D), torch.zeros(LAYERS + 1, 4, H, D))

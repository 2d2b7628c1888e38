"""Blending is exact where it must be: ratio 1.0 is a prefill; one segment at position 0 with ratio 0 is the cache.

Tiny random float32 Llama/Qwen2/Qwen3/Mistral models built with transformers on CPU.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmi_cache.blend.blender import BlendOutcome, blend, naive_concat, next_token_logits, prefill, segment_kv
from lmi_cache.blend.hf_adapter import HFLayerwiseModel
from lmi_cache.blend.quality import BlendCase, QualityTally, run_conditions, standard_conditions
from blend_models import VOCAB, tiny_model

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="module", params=MODEL_TYPES)
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_model("llama")


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _case(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    return _ids(6, seed), [_ids(30, seed + 1), _ids(45, seed + 2), _ids(20, seed + 3)], _ids(8, seed + 4)


def test_our_prefill_matches_transformers(model: Any) -> None:
    adapter = HFLayerwiseModel(model)
    ids = _ids(80, 9)
    with torch.no_grad():
        reference = model(ids[None]).logits[0]
        _, hidden = prefill(adapter, ids)
        torch.testing.assert_close(adapter.logits(hidden), reference, rtol=1e-4, atol=1e-4)
        # Prefill in two steps (a prefix cache hit) is the same computation.
        past, _ = prefill(adapter, ids[:33])
        _, rest = prefill(adapter, ids[33:], past)
        torch.testing.assert_close(adapter.logits(rest), reference[33:], rtol=1e-4, atol=1e-4)


def test_ratio_one_is_a_full_prefill(model: Any) -> None:
    adapter = HFLayerwiseModel(model)
    prefix, segments, tail = _case()
    with torch.no_grad():
        prefix_kv, _ = prefill(adapter, prefix)
        body_kv, _ = prefill(adapter, torch.cat(segments), prefix_kv)
        cached = [segment_kv(adapter, s) for s in segments]
        n = sum(s.numel() for s in segments)
        out = blend(adapter, prefix_kv, segments, cached, check_layers=[1], recompute_counts=[n])
        exact = prefix_kv.cat(body_kv)
        assert torch.equal(out.kv.k, exact.k) and torch.equal(out.kv.v, exact.v)
        assert torch.equal(out.recomputed, torch.arange(n))
        reference = model(torch.cat((prefix, *segments, tail))[None]).logits[0, -1]
        logits = next_token_logits(adapter, out.kv, tail)
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        assert int(logits.argmax()) == int(reference.argmax())


def test_single_segment_at_position_zero_with_ratio_zero_is_exact(model: Any) -> None:
    adapter = HFLayerwiseModel(model)
    segment, tail = _ids(40, 3), _ids(10, 4)
    with torch.no_grad():
        cached = segment_kv(adapter, segment)
        empty = type(cached)(cached.k[:, :0], cached.v[:, :0])
        out = blend(adapter, empty, [segment], [cached], check_layers=[1], recompute_counts=[0])
        assert out.recomputed.numel() == 0
        assert torch.equal(out.kv.k, cached.k) and torch.equal(out.kv.v, cached.v)
        reference = model(torch.cat((segment, tail))[None]).logits[0, -1]
        logits = next_token_logits(adapter, out.kv, tail)
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def _partial_blend(llama: Any) -> tuple[HFLayerwiseModel, int, Any, Any, Callable[..., BlendOutcome]]:
    """(adapter, prefix length, exact KV, naive KV, blend of case 5's segments with the given keyword arguments)."""
    adapter = HFLayerwiseModel(llama)
    prefix, segments, _ = _case(5)
    with torch.no_grad():
        prefix_kv, _ = prefill(adapter, prefix)
        exact = prefix_kv.cat(prefill(adapter, torch.cat(segments), prefix_kv)[0])
        cached = [segment_kv(adapter, s) for s in segments]
        naive = naive_concat(adapter, prefix_kv, cached)

    def run(**kwargs: Any) -> BlendOutcome:
        with torch.no_grad():
            return blend(adapter, prefix_kv, segments, cached, **kwargs)

    return adapter, prefix.numel(), exact, naive, run


def test_partial_blend_keeps_exact_layers_and_cached_rows(llama: Any) -> None:
    """Prefix rows and layers up to the check layer are exact; unselected rows past it are the cached KV."""
    _, p, exact, naive, run = _partial_blend(llama)
    out: BlendOutcome = run(check_layers=[1], recompute_counts=[14], gradual=False)
    assert out.recomputed.numel() == 14
    torch.testing.assert_close(out.kv.k[:2], exact.k[:2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.kv.v[:2], exact.v[:2], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.kv.k[:, :p], exact.k[:, :p])  # the prefix's own KV
    kept = torch.ones(exact.num_tokens - p, dtype=torch.bool)
    kept[out.recomputed] = False
    assert torch.equal(out.kv.k[2:, p:][:, kept], naive.k[2:, p:][:, kept])
    assert not torch.allclose(out.kv.k[2:, p:][:, ~kept], naive.k[2:, p:][:, ~kept])


def test_one_check_layer_is_gradual_filtering(llama: Any) -> None:
    """Check layer 1 keeping 14: layer 2 recomputes 28 rows, layer 3 (the last) 21, and 14 of those stay."""
    _, p, exact, naive, run = _partial_blend(llama)
    out = run(check_layers=[1], recompute_counts=[14])
    same = run(check_layers=[1, 2, 3], recompute_counts=[28, 21, 14], gradual=False)
    torch.testing.assert_close(out.kv.k[:2], exact.k[:2], rtol=1e-5, atol=1e-5)
    fresh = [(out.kv.k[layer, p:] != naive.k[layer, p:]).flatten(1).any(dim=1) for layer in (2, 3)]
    assert [int(f.sum()) for f in fresh] == [28, 21]
    assert bool(fresh[0][fresh[1]].all())  # layer 3's rows are among layer 2's
    assert out.recomputed.numel() == 14 and bool(fresh[1][out.recomputed].all())
    assert torch.equal(out.kv.k, same.kv.k) and torch.equal(out.recomputed, same.recomputed)


def test_random_blend_needs_a_generator(llama: Any) -> None:
    adapter = HFLayerwiseModel(llama)
    segment = _ids(10, 1)
    cached = segment_kv(adapter, segment)
    empty = type(cached)(cached.k[:, :0], cached.v[:, :0])
    with pytest.raises(ValueError, match="Generator"):
        blend(adapter, empty, [segment], [cached], [1], [3], selection="random")


def test_quality_curve_ends_exact_and_improves_on_naive() -> None:
    """On a random model the curve is noisy, but ratio 1.0 must be exact and recompute must help on average."""
    adapter = HFLayerwiseModel(tiny_model("llama", seed=3))
    tally = QualityTally()
    for seed in range(3):
        prefix, segments, tail = _case(10 * seed)
        logits = run_conditions(adapter, BlendCase(prefix, tuple(segments), tail),
                                standard_conditions((0.0, 0.3, 1.0)))
        tally.add(logits)
    rows = {r.condition: r for r in tally.rows()}
    assert rows["blend 1"].mean_kl < 1e-8 and rows["blend 1"].greedy_agreement == 1.0
    assert rows["prefix-only caching"].mean_kl < 1e-8
    assert rows["naive concatenation"].mean_kl > 1e-3
    assert rows["blend 0.3"].mean_kl < rows["naive concatenation"].mean_kl


def test_uncached_segment_is_computed_in_full(llama: Any) -> None:
    adapter = HFLayerwiseModel(llama)
    prefix, segments, tail = _case(7)
    with torch.no_grad():
        prefix_kv, _ = prefill(adapter, prefix)
        exact = prefix_kv.cat(prefill(adapter, torch.cat(segments), prefix_kv)[0])
        cached = [segment_kv(adapter, segments[0]), None, segment_kv(adapter, segments[2])]
        n_cached = segments[0].numel() + segments[2].numel()
        full = blend(adapter, prefix_kv, segments, cached, [1], [n_cached])
        assert torch.equal(full.kv.k, exact.k) and torch.equal(full.kv.v, exact.v)
        none = blend(adapter, prefix_kv, segments, cached, [1], [0])
    first, second = segments[0].numel(), segments[1].numel()
    assert torch.equal(none.recomputed, torch.arange(first, first + second))

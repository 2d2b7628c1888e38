"""The native scattered-query attention (csrc/scattered_attention_cpu.cpp) against the reference.

Every compiled vector variant this CPU runs (AVX-512, AVX2, the baseline build) is checked
against ``blend.attention.attend`` (torch SDPA with an explicit position mask) over shapes
that cross its tiles (64 keys), groups (64 query rows per KV head) and key segments.
"""
from __future__ import annotations

import pytest
import torch

from lmi_cache.blend.attention import attend
from lmi_cache.transfer import kernels

def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    return attend(q, k, v, positions, torch.arange(k.shape[0]), scale).reshape(q.shape)


def _case(num_keys: int, num_queries: int, heads: int, kv_heads: int, dim: int, seed: int,
          positions: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_queries, heads, dim, generator=gen)
    k = torch.randn(num_keys, kv_heads, dim, generator=gen)
    v = torch.randn(num_keys, kv_heads, dim, generator=gen)
    if positions is None:
        positions = torch.sort(torch.randperm(num_keys, generator=gen)[:num_queries]).values
    return q, k, v, positions


def test_the_widest_variant_is_listed_first_and_generic_is_always_there() -> None:
    isas = kernels.scattered_attention_isas()
    assert isas[-1] == "generic"
    assert set(isas) <= {"avx512", "avx2", "generic"} and len(set(isas)) == len(isas)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
@pytest.mark.parametrize(("num_keys", "num_queries", "heads", "kv_heads", "dim", "split"), [
    (8111, 1211, 8, 4, 64, 64),   # the RAG benchmark's shape: 15% scattered, a 64-token prefix
    (300, 40, 8, 2, 32, 0),       # no prefix (an empty first segment)
    (100, 100, 7, 1, 16, 5),      # every token: 7 heads per KV head pad a 64-row group
    (500, 37, 28, 4, 128, 130),   # Qwen-like 7 heads per KV head, head_dim 128, split off a tile edge
    (70, 1, 4, 4, 64, 3),         # one query, MHA
    (1000, 200, 64, 1, 8, 999),   # 64 heads on one KV head: one query per group; the split one key before the end
    (129, 65, 2, 2, 256, 64),     # the largest head_dim; segments at a tile edge
])
def test_native_equals_the_reference_attention(isa: str, num_keys: int, num_queries: int, heads: int,
                                               kv_heads: int, dim: int, split: int) -> None:
    if isa not in kernels.scattered_attention_isas():
        pytest.skip(f"this CPU has no {isa}")
    q, k, v, positions = _case(num_keys, num_queries, heads, kv_heads, dim, seed=num_keys + dim)
    got = kernels.scattered_attention(q, positions, [k[:split], k[split:]], [v[:split], v[split:]], dim**-0.5, isa=isa)
    torch.testing.assert_close(got, _reference(q, k, v, positions, dim**-0.5), atol=2e-6, rtol=1e-5)


def test_edge_positions_first_and_last_key_and_consecutive_runs() -> None:
    positions = torch.tensor([0, 1, 2, 63, 64, 65, 200, 510, 511])
    q, k, v, positions = _case(512, positions.numel(), 4, 2, 64, seed=3, positions=positions)
    got = kernels.scattered_attention(q, positions, [k], [v], 0.125)
    torch.testing.assert_close(got, _reference(q, k, v, positions, 0.125), atol=2e-6, rtol=1e-5)
    # Query 0 sees key 0 only: its output is V[0] (per head, through its KV head).
    torch.testing.assert_close(got[0], v[0].repeat_interleave(2, dim=0))


def test_strided_rows_and_many_segments_give_the_same_result() -> None:
    q, k, v, positions = _case(700, 90, 8, 4, 64, seed=4)
    kv = torch.stack((k, v), dim=1)  # [T, 2, H_kv, D]: K and V rows interleaved, token stride 2*H_kv*D
    cuts = [0, 1, 64, 65, 300, 700]
    keys = [kv[a:b, 0] for a, b in zip(cuts, cuts[1:])]
    values = [kv[a:b, 1] for a, b in zip(cuts, cuts[1:])]
    got = kernels.scattered_attention(q, positions, keys, values, 0.125)
    torch.testing.assert_close(got, kernels.scattered_attention(q, positions, [k], [v], 0.125), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, _reference(q, k, v, positions, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_grouping_does_not_change_a_rows_result(isa: str) -> None:
    # A query's row is summed in the same order whichever other queries share its group; a
    # short last group (here one query, 2 rows: its other row vectors are skipped) too.
    if isa not in kernels.scattered_attention_isas():
        pytest.skip(f"this CPU has no {isa}")
    q, k, v, positions = _case(900, 150, 8, 4, 64, seed=5)
    full = kernels.scattered_attention(q, positions, [k], [v], 0.125, isa=isa)
    part = kernels.scattered_attention(q[7:40], positions[7:40], [k], [v], 0.125, isa=isa)
    assert torch.equal(full[7:40], part)


def test_large_scores_stay_finite_and_match() -> None:
    q, k, v, positions = _case(400, 50, 4, 4, 32, seed=6)
    q = q * 30  # scores in the hundreds: the running max must keep exp() in range
    got = kernels.scattered_attention(q, positions, [k], [v], 32**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _reference(q, k, v, positions, 32**-0.5), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_lse_is_each_rows_log_sum_exp_of_the_scaled_scores(isa: str) -> None:
    if isa not in kernels.scattered_attention_isas():
        pytest.skip(f"this CPU has no {isa}")
    q, k, v, positions = _case(700, 90, 8, 4, 64, seed=9)
    lse = torch.full((90, 8), float("nan"))
    got = kernels.scattered_attention(q, positions, [k[:100], k[100:]], [v[:100], v[100:]], 0.125, isa=isa, lse=lse)
    scores = torch.einsum("qhd,khd->qhk", q, k.repeat_interleave(2, dim=1)) * 0.125
    scores = scores.masked_fill(torch.arange(700)[None, None, :] > positions[:, None, None], float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=2e-5, rtol=1e-5)
    # Asking for the lse changes nothing else.
    assert torch.equal(got, kernels.scattered_attention(q, positions, [k[:100], k[100:]], [v[:100], v[100:]], 0.125,
                                                        isa=isa))


def test_queries_may_share_a_causal_limit() -> None:
    # Attention to what precedes a segment: every query of the segment gets the limit of the
    # last token before it, whatever its own place (RoPE is already in q).
    q, k, v, _ = _case(300, 70, 4, 2, 32, seed=10)
    limits = torch.tensor([99] * 40 + [199] * 30)
    lse = torch.empty(70, 4)
    got = kernels.scattered_attention(q, limits, [k], [v], 0.2, lse=lse)
    torch.testing.assert_close(got, _reference(q, k, v, limits, 0.2), atol=2e-6, rtol=1e-5)
    first = kernels.scattered_attention(q[:40], torch.full((40,), 99), [k[:100]], [v[:100]], 0.2)
    torch.testing.assert_close(got[:40], first, atol=1e-6, rtol=1e-6)


def test_a_bad_lse_buffer_is_refused() -> None:
    q, k, v, positions = _case(20, 2, 4, 2, 8, seed=11, positions=torch.tensor([3, 9]))
    with pytest.raises(RuntimeError, match="lse must be"):
        kernels.scattered_attention(q, positions, [k], [v], 1.0, lse=torch.empty(2, 3))


def test_no_queries_gives_an_empty_result() -> None:
    _, k, v, _ = _case(10, 1, 2, 2, 8, seed=7)
    out = kernels.scattered_attention(torch.empty(0, 2, 8), torch.empty(0, dtype=torch.long), [k], [v], 1.0)
    assert out.shape == (0, 2, 8)


@pytest.mark.parametrize(("change", "message"), [
    (lambda q, p, k, v: (q, torch.tensor([5, 3]), k, v), "must be ascending"),
    (lambda q, p, k, v: (q, torch.tensor([3, 50]), k, v), "outside the 20 keys"),
    (lambda q, p, k, v: (q.double(), p, k, v), "float32"),
    (lambda q, p, k, v: (q[:, :, :6].contiguous(), p, [t[:, :, :6].contiguous() for t in k],
                         [t[:, :, :6].contiguous() for t in v]), "multiple of 8"),
    (lambda q, p, k, v: (q[:, :3].contiguous(), p, k, v), "multiple of kv heads"),
    (lambda q, p, k, v: (q, p, k, v + v), "one value tensor per key tensor"),
    (lambda q, p, k, v: (q, p.int(), k, v), "int64"),
    (lambda q, p, k, v: (q, p, [k[0].transpose(0, 1)], v), "rows of head_dim"),
])
def test_bad_arguments_raise_one_clear_error(change, message: str) -> None:  # type: ignore[no-untyped-def]
    q, k, v, positions = _case(20, 2, 4, 2, 8, seed=8, positions=torch.tensor([3, 9]))
    args = change(q, positions, [k], [v])
    with pytest.raises(RuntimeError, match=message):
        kernels.scattered_attention(*args, 1.0)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "takes"), [
    (8, 4, 64, True), (64, 1, 8, True), (2, 2, 256, True),
    (8, 4, 36, False), (8, 4, 264, False), (130, 1, 32, False), (8, 3, 64, False),
])
def test_supports_answers_what_the_op_accepts(heads: int, kv_heads: int, dim: int, takes: bool) -> None:
    assert kernels.scattered_attention_supports(heads, kv_heads, dim) is takes
    q, k, v, positions = _case(20, 2, heads, kv_heads, dim, seed=10, positions=torch.tensor([3, 9]))
    if takes:
        kernels.scattered_attention(q, positions, [k], [v], 1.0)
    else:
        with pytest.raises(RuntimeError, match="scattered attention: (heads|head_dim) must"):
            kernels.scattered_attention(q, positions, [k], [v], 1.0)


def test_an_isa_this_cpu_lacks_or_does_not_know_is_refused() -> None:
    q, k, v, positions = _case(20, 2, 4, 2, 8, seed=9)
    with pytest.raises(RuntimeError, match="cannot run the 'sse9' code"):
        kernels.scattered_attention(q, positions, [k], [v], 1.0, isa="sse9")


def _torch_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    c, s = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
    return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s


@pytest.mark.parametrize(("layers", "tokens", "heads", "dim"), [(8, 300, 4, 64), (1, 1, 1, 2), (3, 129, 2, 128)])
def test_rotate_pairs_equals_the_rotate_half_formula(layers: int, tokens: int, heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    data = torch.randn(layers, 2, tokens, heads, dim, generator=gen)  # a stored segment: [layers, K/V, T, H, D]
    x = data[:, 0]
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    out = torch.full((layers, tokens + 10, heads, dim), float("nan"))[:, 5 : 5 + tokens]  # a view, as blending writes
    kernels.rotate_pairs(x, cos, sin, out)
    torch.testing.assert_close(out, _torch_rotation(x, cos, sin), atol=1e-6, rtol=1e-6)
    in_place = x.clone()
    kernels.rotate_pairs(in_place, cos, sin, in_place)
    torch.testing.assert_close(in_place, out, atol=0, rtol=0)


def test_rotate_pairs_refuses_a_partial_overlap_and_bad_angles() -> None:
    x = torch.randn(1, 10, 2, 8)
    angles = torch.rand(10, 4)
    with pytest.raises(RuntimeError, match="out overlaps x"):
        buf = torch.randn(1, 11, 2, 8)
        kernels.rotate_pairs(buf[:, :10], angles.cos(), angles.sin(), buf[:, 1:])
    with pytest.raises(RuntimeError, match=r"head_dim / 2"):
        kernels.rotate_pairs(x, torch.rand(10, 8), torch.rand(10, 8), torch.empty_like(x))

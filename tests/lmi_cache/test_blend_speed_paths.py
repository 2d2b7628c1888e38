"""The blend's fast paths give the reference results: RoPE written in place, vLLM's rotary op,
re-rotation of every layer at once, the kernel plan reused across layers, and the
worker skipping layers its attention already wrote (tiny float32 models on CPU).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from blend_models import VOCAB, DictEngine, tiny_model

from lmi_cache.blend import layer0_reuse
from lmi_cache.blend.attention import attend
from lmi_cache.blend.blender import KVStack, blend, prefill, rerotated_segments, segment_kv
from lmi_cache.vllm_connector.cpu_paged_attention import CpuPagedAttention
from lmi_cache.blend.hf_adapter import HFLayerwiseModel
from lmi_cache.blend.jobs import BlendJob, BlendPiece, SegmentStore
from lmi_cache.blend.paged_kv import PagedKV
from lmi_cache.blend.rope import RopeSpec, apply_rope, rerotate
from lmi_cache.blend.settings import BlendSettings
from lmi_cache.blend.worker_jobs import BlendWorker
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.transfer import kernels
from lmi_cache.transfer.layouts import ExpectedGeometry, describe_kv_caches

N = 32  # CPU kernel block size (a multiple of 32, as vLLM's CPU platform uses)


def _textbook_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    cos, sin = spec.cos_sin(positions)
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]


def test_rope_in_place_form_equals_the_rotate_half_formula_and_keeps_gradients() -> None:
    spec = RopeSpec(head_dim=32, theta=500000.0, rope_type="llama3", factor=8.0)
    x = torch.randn(40, 3, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.randint(0, 9000, (40,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(apply_rope(x, positions, spec), _textbook_rope(x, positions, spec))
    leaf = x.clone().requires_grad_(True)
    apply_rope(leaf, positions, spec).sum().backward()
    assert leaf.grad is not None and bool(torch.isfinite(leaf.grad).all())


def test_rerotate_moves_every_layer_at_once_into_a_view() -> None:
    spec = RopeSpec(head_dim=16)
    gen = torch.Generator().manual_seed(2)
    raw = torch.randn(4, 25, 2, 16, generator=gen)  # [layers, tokens, heads, dim]
    old, new = torch.arange(25), torch.arange(300, 325)
    cached = torch.stack([apply_rope(layer, old, spec) for layer in raw])
    target = torch.full((4, 40, 2, 16), float("nan"))
    rerotate(cached, old, new, spec, out=target[:, 10:35])
    want = torch.stack([apply_rope(layer, new, spec) for layer in raw])
    torch.testing.assert_close(target[:, 10:35], want)
    assert bool(target[:, :10].isnan().all()) and bool(target[:, 35:].isnan().all())  # nothing else touched
    same = rerotate(cached, old, old, spec, out=torch.empty_like(cached))
    assert torch.equal(same, cached)  # a segment at its own place is copied bit for bit


def test_rerotated_segments_zero_an_uncached_segment() -> None:
    model = HFLayerwiseModel(tiny_model("llama"))
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        kv = segment_kv(model, ids[:12])
        out = rerotated_segments(model, [None, kv], [18, 12], start=5)
        want, _ = prefill(model, ids[:12], KVStack(torch.zeros(4, 23, 2, 16), torch.zeros(4, 23, 2, 16)))
    assert not bool(out.k[:, :18].any()) and not bool(out.v[:, :18].any())
    torch.testing.assert_close(out.k[0, 18:], want.k[0])  # layer 0 K only depends on the token and its position
    assert torch.equal(out.v[:, 18:], kv.v)


class _OwnRope:
    """A LayerwiseModel that brings its own RoPE (as the vLLM adapter does), counting its calls."""

    def __init__(self, inner: HFLayerwiseModel) -> None:
        self.inner = inner
        self.num_layers, self.attn_scale, self.rope = inner.num_layers, inner.attn_scale, inner.rope
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def rope_qk(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return _textbook_rope(q, positions, self.rope), _textbook_rope(k, positions, self.rope)


def test_blend_uses_the_models_own_rope_when_offered() -> None:
    inner = HFLayerwiseModel(tiny_model("llama"))
    own = _OwnRope(inner)
    gen = torch.Generator().manual_seed(4)
    prefix, seg_a, seg_b = (torch.randint(0, VOCAB, (n,), generator=gen) for n in (6, 30, 25))
    with torch.inference_mode():
        prefix_kv, _ = prefill(inner, prefix)
        cached = [segment_kv(inner, seg_a), segment_kv(inner, seg_b)]
        want = blend(inner, prefix_kv, [seg_a, seg_b], cached, [1], [8])
        got = blend(own, prefix_kv, [seg_a, seg_b], cached, [1], [8])
    assert own.calls == inner.num_layers
    assert torch.equal(got.recomputed, want.recomputed)
    torch.testing.assert_close(got.kv.k, want.kv.k)
    torch.testing.assert_close(got.kv.v, want.kv.v)


@pytest.mark.vllm
def test_vllm_adapter_rope_equals_ours() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from lmi_cache.vllm_connector.blend_model import VllmLayerwiseModel

    with set_current_vllm_config(VllmConfig()):
        rotary = get_rope(16, max_position=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          is_neox_style=True)
    attn = torch.nn.Module()
    attn.rotary_emb, attn.head_dim, attn.q_size, attn.kv_size = rotary, 16, 64, 32
    layer = torch.nn.Module()
    layer.self_attn = attn
    top = torch.nn.Module()
    top.model = torch.nn.Module()
    top.model.layers = torch.nn.ModuleList([layer])
    top.model.embed_tokens = torch.nn.Embedding(8, 64)
    adapter = VllmLayerwiseModel(top, {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                       "num_key_value_heads": 2})
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(20, 128, generator=gen)  # q and k are strided views of one projection, as in vLLM
    q, k = qkv[:, :64].view(20, 4, 16), qkv[:, 64:96].view(20, 2, 16)
    positions = torch.arange(1000, 1020)
    want_q, want_k = apply_rope(q, positions, adapter.rope), apply_rope(k, positions, adapter.rope)
    got_q, got_k = adapter.rope_qk(0, q, k, positions)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


def _paged_attention(num_blocks: int, layers: int, heads: int, kv_heads: int,
                     dim: int) -> tuple[CpuPagedAttention, list[torch.Tensor]]:
    caches = [torch.zeros(num_blocks, kv_heads, N, 2 * dim) for _ in range(layers)]
    return CpuPagedAttention(caches, [object()], N, heads, kv_heads, dim, dim**-0.5), caches


@pytest.mark.vllm
@pytest.mark.parametrize("which", ["scattered", "single", "all", "runs"])
def test_kernel_attention_equals_the_reference_and_reuses_its_plan_for_the_same_positions(which: str) -> None:
    paged, _ = _paged_attention(8, 2, 4, 2, 32)  # GQA: 4 query heads over 2 KV heads
    paged.bind(range(8))
    gen = torch.Generator().manual_seed(6)
    k, v = torch.randn(200, 2, 32, generator=gen), torch.randn(200, 2, 32, generator=gen)
    for layer in range(2):
        paged.write(layer, 0, k * (layer + 1), v)
    positions = {
        "scattered": torch.sort(torch.randperm(200, generator=gen)[:30]).values,
        "single": torch.tensor([137]),
        "all": torch.arange(200),
        "runs": torch.tensor([3, 4, 40, 41, 42, 97, 150, 199]),  # runs crossing block boundaries (32 tokens)
    }[which]
    q = torch.randn(positions.numel(), 4, 32, generator=gen)
    for layer in range(2):  # the same tensor for both layers: planned once
        torch.testing.assert_close(paged.attend(layer, q, positions),
                                   attend(q, k * (layer + 1), v, positions, torch.arange(200), 32**-0.5))
    other = torch.tensor([0, 1, 2, 120])  # a new positions tensor: planned anew
    torch.testing.assert_close(paged.attend(0, q[:1].expand(4, -1, -1).contiguous(), other),
                               attend(q[:1].expand(4, -1, -1), k, v, other, torch.arange(200), 32**-0.5))


@pytest.mark.vllm
def test_worker_with_the_kernel_writes_each_layer_once_and_equals_a_prefill() -> None:
    hf = tiny_model("llama", hidden_size=128)  # head dim 32: the CPU kernel's smallest
    model = HFLayerwiseModel(hf)
    kv_heads, dim = hf.config.num_key_value_heads, model.head_dim
    paged_attention, caches = _paged_attention(8, model.num_layers, hf.config.num_attention_heads, kv_heads, dim)
    layout = describe_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(caches)},
                                ExpectedGeometry(block_size_tokens=N, num_kv_heads=kv_heads, head_size=dim))
    settings = BlendSettings(enabled=True, recompute_ratios=(1.0,), min_tokens=0)
    worker = BlendWorker(settings, model, PagedKV(caches, layout, N), 0, paged_attention=paged_attention)
    writes: list[int] = []
    original_write = paged_attention.write

    def counting_write(layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        writes.append(layer)
        original_write(layer, start, k, v)

    paged_attention.write = counting_write  # type: ignore[method-assign]
    engine = DictEngine()
    gen = torch.Generator().manual_seed(7)
    prefix, seg_a, seg_b = (torch.randint(0, VOCAB, (n,), generator=gen) for n in (20, 40, 35))
    keys = (ChunkKey(b"a" * 16, 0, 40, 1), ChunkKey(b"b" * 16, 0, 35, 2))
    worker.run_stores([SegmentStore("r", tuple(seg_a.tolist()), (keys[0],), ("cpu",)),
                       SegmentStore("r", tuple(seg_b.tolist()), (keys[1],), ("cpu",))], engine)
    with torch.inference_mode():
        prefix_kv, _ = prefill(model, prefix)
        want, _ = prefill(model, torch.cat((seg_b, seg_a)), prefix_kv)
    block_ids = tuple(range(1, 5))
    worker.paged.write(block_ids, 0, prefix_kv.k, prefix_kv.v)
    writes.clear()
    job = BlendJob("r", 20, tuple(torch.cat((seg_b, seg_a)).tolist()),
                   (BlendPiece(20, 55, (keys[1],), "cpu"), BlendPiece(55, 95, (keys[0],), "cpu")), block_ids)
    assert worker.run_blends([job], engine) == set()
    assert sorted(writes) == list(range(model.num_layers))  # once per layer, not twice
    assert worker.stats.blend_write_seconds > 0  # the writes inside the attention are still counted
    got_k, got_v = worker.paged.read(block_ids, 20, 95)
    torch.testing.assert_close(got_k, want.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_v, want.v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_low_precision_cache_rerotates_through_float32_into_a_view(dtype: torch.dtype) -> None:
    spec = RopeSpec(head_dim=32)
    k = apply_rope(torch.randn(2, 8, 2, 32), torch.arange(8), spec)
    target = torch.zeros(2, 8, 2, 32, dtype=dtype)
    rerotate(k.to(dtype), torch.arange(8), torch.arange(500, 508), spec, out=target)
    torch.testing.assert_close(target.float(), rerotate(k, torch.arange(8), torch.arange(500, 508), spec),
                               rtol=2e-2, atol=2e-2)


class _SliceSpy:
    """A LayerwiseModel that records how many rows each finish_layer call got."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.rows: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        self.rows.append(int(hidden.shape[0]))
        return self._inner.finish_layer(layer, hidden, attn)


def test_wide_layers_finish_in_slices_with_the_unsliced_result(monkeypatch: pytest.MonkeyPatch) -> None:
    import lmi_cache.blend.blender as blender

    model = HFLayerwiseModel(tiny_model("llama"))
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, VOCAB, (6,), generator=gen)
    segments = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (23, 18)]
    with torch.inference_mode():
        prefix_kv, _ = prefill(model, prefix, None)
        cached = [segment_kv(model, seg) for seg in segments]
        whole = blend(model, prefix_kv, segments, cached, [1], [9])
        whole_prefill, _ = prefill(model, torch.cat(segments), prefix_kv)
        monkeypatch.setattr(blender, "FINISH_SLICE_TOKENS", 7)
        spy = _SliceSpy(model)
        sliced = blend(spy, prefix_kv, segments, cached, [1], [9])
        sliced_prefill, _ = prefill(spy, torch.cat(segments), prefix_kv)
    assert max(spy.rows) <= 7 and spy.rows.count(7) >= 10, spy.rows  # the 41-token layers went in slices
    assert torch.equal(sliced.recomputed, whole.recomputed)
    # Row slices of a matmul may sum in another order: equal to float32 round-off.
    for got, want in ((sliced.kv.k, whole.kv.k), (sliced.kv.v, whole.kv.v), (sliced_prefill.k, whole_prefill.k)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.vllm
def test_scattered_queries_use_the_native_kernel_and_a_single_run_vllms() -> None:
    paged, _ = _paged_attention(8, 1, 4, 2, 32)
    native = kernels.backend() == "native"  # CI builds the kernels; LMI_CACHE_KERNELS=torch turns them off
    assert paged.native_scattered == native  # float32 and vLLM's "vec" ISA: only the backend decides
    gen = torch.Generator().manual_seed(8)
    prefix_k, prefix_v = torch.randn(1, 20, 2, 32, generator=gen), torch.randn(1, 20, 2, 32, generator=gen)
    k, v = torch.randn(180, 2, 32, generator=gen), torch.randn(180, 2, 32, generator=gen)
    paged.bind(range(8))
    paged.write(0, 0, prefix_k[0], prefix_v[0])
    hook = paged.layer_attention(20, KVStack(prefix_k, prefix_v))
    all_k, all_v = torch.cat((prefix_k[0], k)), torch.cat((prefix_v[0], v))
    for positions in (torch.sort(20 + torch.randperm(180, generator=gen)[:25]).values, torch.arange(20, 200)):
        q = torch.randn(positions.numel(), 4, 32, generator=gen)
        calls = paged.native_calls
        got = hook(0, q, positions, k, v)
        torch.testing.assert_close(got, attend(q, all_k, all_v, positions, torch.arange(200), 32**-0.5))
        # Scattered: lmi-cache's kernel; one run (every token): vLLM's, as vLLM's own prefill.
        assert paged.native_calls == calls + (1 if native and positions.numel() == 25 else 0)
    without_prefix = paged.layer_attention(20)  # no prefix K/V given: vLLM's kernel for everything
    calls = paged.native_calls
    without_prefix(0, q[:5], torch.tensor([21, 40, 41, 90, 150]), k, v)
    assert paged.native_calls == calls


def _two_segment_blend(native: bool, monkeypatch: pytest.MonkeyPatch | None = None,
                       attention_objects: str = "kept") -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
    """Store two segments, blend them after a 20-token prefix at ratio 0.3: (worker stats, blended K/V).

    ``attention_objects``: "kept", "dropped" (removed from the engine before the blend) or
    "failing" (their store raises).
    """
    hf = tiny_model("llama", hidden_size=128)
    model = HFLayerwiseModel(hf)
    kv_heads, dim, heads = hf.config.num_key_value_heads, model.head_dim, hf.config.num_attention_heads
    gen = torch.Generator().manual_seed(9)
    prefix, seg_a, seg_b = (torch.randint(0, VOCAB, (n,), generator=gen) for n in (20, 90, 70))
    keys = (ChunkKey(b"a" * 16, 0, 90, 1), ChunkKey(b"b" * 16, 0, 70, 2))
    paged_attention, caches = _paged_attention(8, model.num_layers, heads, kv_heads, dim)
    paged_attention.native_scattered = native
    layout = describe_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(caches)},
                                ExpectedGeometry(block_size_tokens=N, num_kv_heads=kv_heads, head_size=dim))
    settings = BlendSettings(enabled=True, recompute_ratios=(0.3,), min_tokens=0)
    worker = BlendWorker(settings, model, PagedKV(caches, layout, N), 0, paged_attention=paged_attention)
    if attention_objects == "failing":
        assert monkeypatch is not None

        def fail(*args: Any) -> None:
            raise RuntimeError("store down")

        monkeypatch.setattr(worker, "_save_layer0_attention", fail)
    engine = DictEngine()
    # The directory placed each segment and its layer-0 attention object in the CPU tier.
    worker.run_stores([SegmentStore("r", tuple(seg_a.tolist()), (keys[0],), ("cpu",), ("cpu",)),
                       SegmentStore("r", tuple(seg_b.tolist()), (keys[1],), ("cpu",), ("cpu",))], engine)
    if attention_objects == "dropped":
        for key in keys:
            del engine.objects[layer0_reuse.attention_key(key).digest]
    with torch.inference_mode():
        prefix_kv, _ = prefill(model, prefix)
    block_ids = tuple(range(1, 7))
    worker.paged.write(block_ids, 0, prefix_kv.k, prefix_kv.v)
    job = BlendJob("r", 20, tuple(torch.cat((seg_b, seg_a)).tolist()),
                   (BlendPiece(20, 90, (keys[1],), "cpu", attention_source="cpu"),
                    BlendPiece(90, 180, (keys[0],), "cpu", attention_source="cpu")), block_ids)
    assert worker.run_blends([job], engine) == set()
    assert (paged_attention.native_calls > 0) == native  # scattered recomputed tokens took the native kernel
    return worker.stats, worker.paged.read(block_ids, 20, 180)


@pytest.mark.vllm
def test_a_blend_with_the_native_kernel_equals_one_with_vllms() -> None:
    results = {}
    for native in (True, False):
        stats, results[native] = _two_segment_blend(native)
        # With the native kernel the segments' layer-0 attention is stored and merged (every blended
        # token has the prefix before it); without it, neither.
        assert stats.num_layer0_attention_stored == (2 if native else 0)
        assert stats.num_layer0_reused_tokens == (160 if native else 0)
    # The merge rounds differently from one pass over all keys; four layers amplify it a little.
    torch.testing.assert_close(results[True][0], results[False][0], atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(results[True][1], results[False][1], atol=5e-5, rtol=1e-4)


@pytest.mark.vllm
@pytest.mark.parametrize("attention_objects", ["dropped", "failing"])
def test_without_stored_attention_layer0_runs_in_full_and_the_segment_still_counts(
        attention_objects: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stats, (k, v) = _two_segment_blend(True, monkeypatch, attention_objects)
    assert stats.num_segments_stored == 2 and stats.num_segment_store_faults == 0
    assert stats.num_layer0_attention_stored == (2 if attention_objects == "dropped" else 0)
    assert stats.num_layer0_reused_tokens == 0 and stats.num_blend_faults == 0
    # Layer 0 in one pass of vLLM's kernel, as without the native kernel's merge.
    _, (want_k, want_v) = _two_segment_blend(False)
    torch.testing.assert_close(k, want_k, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(v, want_v, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "takes"),
                         [(8, 4, 64, True), (8, 4, 36, False), (8, 4, 512, False), (130, 1, 32, False)])
@pytest.mark.vllm
def test_shapes_the_native_kernel_cannot_take_stay_on_vllms(heads: int, kv_heads: int, dim: int, takes: bool) -> None:
    # head_dim not a multiple of 8, above 256, or more than 64 query heads per KV head: vLLM's kernel.
    paged = CpuPagedAttention([torch.zeros(2, kv_heads, N, 2 * dim)], [object()], N, heads, kv_heads, dim, 1.0)
    assert paged.native_scattered == (takes and kernels.backend() == "native")

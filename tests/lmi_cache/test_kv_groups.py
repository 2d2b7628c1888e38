"""KV cache groups: reading vLLM's config, the key tag, and which chunks a hit needs (test process, no vLLM)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmi_cache.keys.kv_groups import KvCacheGroup, UnsupportedKvGroups, kv_groups_of, longest_hit_tokens

BLOCK, CHUNK = 128, 256
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))


# Stand-ins named like vLLM's spec classes: kv_groups_of reads class names and attributes only.
@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int = BLOCK


@dataclass(frozen=True)
class SlidingWindowSpec:
    sliding_window: int
    extra_retained_tokens: int = 0


@dataclass(frozen=True)
class MambaSpec:
    shapes: tuple[tuple[int, ...], ...] = ((3, 640), (8, 64, 16))
    dtypes: tuple[object, ...] = ("torch.float32", "torch.float32")
    mamba_cache_mode: str = "align"
    block_size: int = BLOCK


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec:
    block_size: int = BLOCK


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: object


@dataclass
class Config:
    kv_cache_groups: list[Group] = field(default_factory=list)


def test_gemma2_shape_reads_as_one_sliding_and_one_full_group() -> None:
    config = Config([Group([LAYERS[0], LAYERS[2]], SlidingWindowSpec(256)), Group([LAYERS[1], LAYERS[3]], FullAttentionSpec())])
    sliding, full = kv_groups_of(config)
    assert (sliding.index, sliding.sliding_window_tokens, sliding.layer_names) == (0, 256, (LAYERS[0], LAYERS[2]))
    assert (full.index, full.is_sliding, full.layer_names) == (1, False, (LAYERS[1], LAYERS[3]))


def test_a_mamba_group_reads_as_a_state_group_with_its_geometry() -> None:
    state, full = kv_groups_of(Config([Group([LAYERS[0]], MambaSpec()), Group([LAYERS[1]], FullAttentionSpec())]))
    assert (state.index, state.kind, state.is_state, state.is_sliding) == (0, "state", True, False)
    assert state.state_shapes == ((3, 640), (8, 64, 16)) and state.state_dtypes == ("float32", "float32")
    assert full.kind == "full" and not full.is_state


def test_unservable_groups_are_refused_naming_the_group() -> None:
    # Prefix caching off: no boundary states to cache ("none" mode keeps one state per request).
    with pytest.raises(UnsupportedKvGroups, match="group 1 \\(MambaSpec in mamba_cache_mode 'none'"):
        kv_groups_of(Config([Group([LAYERS[0]], FullAttentionSpec()), Group([LAYERS[1]], MambaSpec(mamba_cache_mode="none"))]))
    with pytest.raises(UnsupportedKvGroups, match="group 0 \\(ChunkedLocalAttentionSpec, layers"):
        kv_groups_of(Config([Group([LAYERS[0]], ChunkedLocalAttentionSpec())]))
    with pytest.raises(UnsupportedKvGroups, match="SlidingWindowSpec"):
        kv_groups_of(Config([Group(list(LAYERS), SlidingWindowSpec(256, extra_retained_tokens=3))]))


def test_key_tag_changes_with_window_kind_and_layers() -> None:
    tags = {
        KvCacheGroup(0, LAYERS).key_tag,
        KvCacheGroup(0, LAYERS, 256).key_tag,
        KvCacheGroup(0, LAYERS, 320).key_tag,
        KvCacheGroup(0, LAYERS[:2], 256).key_tag,
        KvCacheGroup(1, LAYERS, 256).key_tag,
    }
    assert len(tags) == 5
    # A state group's tag names its state geometry: other shapes or dtypes are other keys.
    state_tags = {
        KvCacheGroup(0, LAYERS, state_shapes=((3, 640), (8, 64, 16)), state_dtypes=("float32", "float32")).key_tag,
        KvCacheGroup(0, LAYERS, state_shapes=((3, 640), (8, 64, 32)), state_dtypes=("float32", "float32")).key_tag,
        KvCacheGroup(0, LAYERS, state_shapes=((3, 640), (8, 64, 16)), state_dtypes=("bfloat16", "float32")).key_tag,
        KvCacheGroup(0, LAYERS).key_tag,
    }
    assert len(state_tags) == 4


def test_first_needed_block_mirrors_vllm_skipped_tokens() -> None:
    group = KvCacheGroup(0, LAYERS, 320)
    # Resumed at 1024: the next token attends to tokens 705..1024, so blocks from 705 // 128 = 5 are kept.
    assert group.first_needed_token(1024) == 705
    assert group.first_needed_block(1024, BLOCK) == 5
    assert group.first_needed_block(200, BLOCK) == 0
    assert KvCacheGroup(1, LAYERS).first_needed_block(1024, BLOCK) == 0


def _hit(groups: list[KvCacheGroup], held: set[tuple[int, int]], num_chunks: int, max_tokens: int) -> int:
    return longest_hit_tokens(groups, num_chunks, CHUNK, BLOCK, max_tokens, lambda g, c: (g, c) in held)


def test_sliding_group_hits_without_its_early_chunks() -> None:
    sliding = KvCacheGroup(0, LAYERS, 320)
    # Chunks 2 and 3 only (tokens 512..1024): enough for a hit at 1024, whose window starts at block 5.
    assert _hit([sliding], {(0, 2), (0, 3)}, num_chunks=5, max_tokens=1299) == 1024
    # Without chunk 2 the window at 1024 is incomplete; at 768 it needs chunks 1 and 2: no hit.
    assert _hit([sliding], {(0, 3)}, num_chunks=5, max_tokens=1299) == 0


def test_full_group_bounds_an_alternating_model() -> None:
    groups = [KvCacheGroup(0, LAYERS[::2], 256), KvCacheGroup(1, LAYERS[1::2])]
    held = {(1, c) for c in range(3)} | {(0, 2)}
    # Full group holds chunks 0-2 (768 tokens); the window before 768 (from token 513) lies in chunk 2.
    assert _hit(groups, held, num_chunks=4, max_tokens=1000) == 768
    assert _hit(groups, held - {(1, 1)}, num_chunks=4, max_tokens=1000) == 0


def test_cap_leaves_a_token_to_compute_and_aligns_to_blocks() -> None:
    groups = [KvCacheGroup(0, LAYERS, 320)]
    held = {(0, c) for c in range(4)}
    # A 1024-token prompt: at most 1023 tokens, aligned down to 896; its window needs chunks 2 and 3.
    assert _hit(groups, held, num_chunks=4, max_tokens=1023) == 896


@given(
    window=st.integers(1, 1200),
    held_chunks=st.sets(st.integers(0, 7)),
    max_tokens=st.integers(0, 2047),
)
def test_every_hit_is_block_aligned_and_covered(window: int, held_chunks: set[int], max_tokens: int) -> None:
    group = KvCacheGroup(0, LAYERS, window)
    hit = _hit([group], {(0, c) for c in held_chunks}, num_chunks=8, max_tokens=max_tokens)
    assert hit % BLOCK == 0 and hit <= max_tokens
    if hit:
        needed = range(group.first_needed_token(hit) // CHUNK, -(-hit // CHUNK))
        assert all(c in held_chunks for c in needed)


STATE = KvCacheGroup(0, LAYERS[::2], state_shapes=((3, 640),), state_dtypes=("float32",))


def test_state_group_needs_the_one_block_before_the_hit() -> None:
    # vLLM keeps only the state after the hit's last token: block H // block - 1 of the group's table.
    assert STATE.first_needed_block(768, BLOCK) == 5
    assert STATE.first_needed_token(768) == 767


def test_a_hybrid_hit_is_a_chunk_boundary_with_its_state_and_every_chunk_before() -> None:
    groups = [STATE, KvCacheGroup(1, LAYERS[1::2])]
    full = {(1, c) for c in range(4)}
    # States at 512 (chunk 1) and 1024 (chunk 3); attention chunks 0-3: the deepest boundary wins.
    assert _hit(groups, full | {(0, 1), (0, 3)}, num_chunks=4, max_tokens=1299) == 1024
    # Without the state at 1024, the state at 512 (chunk 1) is the hit, not 768 (no state there).
    assert _hit(groups, full | {(0, 1)}, num_chunks=4, max_tokens=1299) == 512
    # A state without the attention chunks before it is no hit; neither are attention chunks without a state.
    assert _hit(groups, {(1, 0), (0, 1), (0, 3)}, num_chunks=4, max_tokens=1299) == 0
    assert _hit(groups, full, num_chunks=4, max_tokens=1299) == 0


def test_a_capped_hybrid_hit_falls_back_to_a_whole_chunk() -> None:
    groups = [STATE, KvCacheGroup(1, LAYERS[1::2])]
    held = {(1, c) for c in range(4)} | {(0, c) for c in range(4)}
    # A 1024-token prompt: at most 1023 tokens; 896 is a block boundary but no chunk's end, so 768.
    assert _hit(groups, held, num_chunks=4, max_tokens=1023) == 768


@given(held_chunks=st.sets(st.integers(0, 7)), held_states=st.sets(st.integers(0, 7)), max_tokens=st.integers(0, 2047))
def test_every_hybrid_hit_has_its_state_and_prefix(held_chunks: set[int], held_states: set[int], max_tokens: int) -> None:
    groups = [STATE, KvCacheGroup(1, LAYERS[1::2])]
    held = {(1, c) for c in held_chunks} | {(0, c) for c in held_states}
    hit = _hit(groups, held, num_chunks=8, max_tokens=max_tokens)
    assert hit % CHUNK == 0 and hit <= max_tokens
    if hit:
        assert hit // CHUNK - 1 in held_states and all(c in held_chunks for c in range(hit // CHUNK))

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


def test_mamba_and_retained_windows_are_refused_naming_the_group() -> None:
    with pytest.raises(UnsupportedKvGroups, match="group 1 \\(MambaSpec"):
        kv_groups_of(Config([Group([LAYERS[0]], FullAttentionSpec()), Group([LAYERS[1]], MambaSpec())]))
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

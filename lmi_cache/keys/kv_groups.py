"""vLLM's KV cache groups as the cache sees them, and which chunks a hit needs (scheduler and worker processes).

With vLLM's hybrid KV cache manager on, a model's attention layers are split
into KV cache groups, each with its own block table: full-attention layers in
one group, sliding-window layers of one window in another (Gemma 2 and gpt-oss
alternate; Mistral-style models window every layer). The cache stores and
loads each group's chunks separately, under a key space that names the group
(its kind, window and layers), so a change of grouping or window is a miss,
never KV read into the wrong layers.

A hit of ``H`` tokens needs, for a full-attention group, every chunk before
``H``; for a sliding-window group of window ``W``, only the blocks vLLM keeps
for a request resumed at ``H``: from token ``H - W + 1`` (vLLM's
``SlidingWindowManager.get_num_skipped_tokens``) rounded down to a block.
Blocks before that are vLLM's null block in the request's block table: they
are neither loaded nor saved.

A state group (vLLM's ``MambaSpec``: Mamba / linear-attention layers of a
hybrid model, prefix caching in "align" mode) keeps one recurrent state per
block boundary: block ``p`` of its block table holds the state after
``(p + 1) * block`` tokens. The cache stores that state at chunk boundaries,
keyed like the chunk that ends there (chunk ``H // chunk - 1`` for boundary
``H``); a hit of ``H`` tokens needs exactly that one state per state group, so
``H`` is a multiple of the chunk. The state geometry (shapes, dtypes) is in
the group's key tag: a change of it is a miss.

An MLA group (vLLM's ``MLAAttentionSpec``: DeepSeek V2/V3, Kimi K2, Mistral
Large 3) is full attention over one latent per token per layer
(``kv_lora_rank + qk_rope_head_dim`` values): a hit needs every chunk before
it, exactly as for a full-attention group. Its pages are copied whole like any
other attention page (the worker's layout kind ``mla`` is in the key space).
vLLM replicates the latent on every TP rank; each rank stores its own copy
under its own keys, which is correct and simple but stores TP copies of the
same bytes. DeepSeek-V3.2's indexer keys (an ``MLAAttentionSpec`` with
``cache_role`` indexer) share one ``UniformTypeKVCacheSpecs`` group and block
table with the latent: such a group is an MLA group whose ``indexer_layers``
name the indexer key caches; its chunks carry both layouts' blocks (the
worker's ``MixedPagedCopier``) and its key tag names the indexer's width.
Indexer keys in any other grouping are refused.

Pure and vLLM-free: :func:`kv_groups_of` reads vLLM's ``KVCacheConfig`` by
attribute, so tests drive everything here with plain objects.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# vLLM's BlockPool hands block 0 out as the null block: the placeholder for blocks a group does not keep.
NULL_BLOCK_ID = 0

# vLLM spec classes the cache can serve, by class name (no vLLM import here). Subclasses of
# FullAttentionSpec with other semantics (sinks, R-SWA) are named so they are refused, not
# mistaken for plain full attention; MLA's latent is its own kind.
_FULL_SPECS = {"FullAttentionSpec"}
_MLA_SPECS = {"MLAAttentionSpec"}
_SLIDING_SPECS = {"SlidingWindowSpec"}
_STATE_SPECS = {"MambaSpec"}

FULL, MLA, SLIDING, STATE = "full", "mla", "sliding", "state"
# Kinds a hit restores from the first token on: every chunk before the hit is needed.
PREFIX_KINDS = (FULL, MLA)


class UnsupportedKvGroups(ValueError):
    """The model has a KV cache group kind the cache cannot store (e.g. chunked local attention)."""


@dataclass(frozen=True)
class KvCacheGroup:
    """One vLLM KV cache group: its position, its layers, and its window (None: full attention).

    A state group (``state_shapes`` non-empty) has, per layer, one state tensor per shape, with the dtype
    of the same position in ``state_dtypes`` (torch dtype names, e.g. "float32"), as vLLM's ``MambaSpec``.
    An MLA group (``latent``) holds one latent per token per layer and is full attention otherwise.
    """

    index: int
    layer_names: tuple[str, ...]
    sliding_window_tokens: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()
    latent: bool = False
    indexer_layers: tuple[str, ...] = ()  # DeepSeek-V3.2: indexer key caches sharing the latent's block table
    indexer_head_size: int = 0  # bytes per token of one indexer key cache (uint8 values)

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window_tokens is not None

    @property
    def is_state(self) -> bool:
        return bool(self.state_shapes)

    @property
    def kind(self) -> str:
        return STATE if self.is_state else SLIDING if self.is_sliding else MLA if self.latent else FULL

    @property
    def key_tag(self) -> str:
        """What the chunk-key namespace records about this group: kind, window or state geometry, layers."""
        if self.is_state:
            kind = "state" + ";".join(f"{d}{list(s)}" for s, d in zip(self.state_shapes, self.state_dtypes))
        else:
            kind = f"sliding{self.sliding_window_tokens}" if self.is_sliding else self.kind
            if self.indexer_layers:
                kind += f"+indexer{self.indexer_head_size}"
        return f"{self.index}:{kind}:{','.join(self.layer_names)}"

    def first_needed_token(self, hit_tokens: int) -> int:
        """First token whose KV (or, for a state group, whose state) a request resumed at ``hit_tokens`` needs."""
        if self.is_state:
            return max(0, hit_tokens - 1)  # vLLM's MambaManager.get_num_skipped_tokens: the last state only
        if self.sliding_window_tokens is None:
            return 0
        return max(0, hit_tokens - self.sliding_window_tokens + 1)

    def first_needed_block(self, hit_tokens: int, block_size_tokens: int) -> int:
        """First block vLLM allocates (not the null block) for this group when a request resumes at ``hit_tokens``."""
        return self.first_needed_token(hit_tokens) // block_size_tokens


def kv_groups_of(kv_cache_config: Any) -> tuple[KvCacheGroup, ...]:
    """The groups of vLLM's ``KVCacheConfig`` (``kv_cache_groups[i].layer_names`` / ``.kv_cache_spec``).

    Raises :class:`UnsupportedKvGroups` naming the first group whose kind the cache cannot store.
    """
    groups = []
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        names = tuple(group.layer_names)
        if kind in _FULL_SPECS:
            groups.append(KvCacheGroup(index, names))
        elif kind in _MLA_SPECS and not is_indexer(spec):
            groups.append(KvCacheGroup(index, names, latent=True))
        elif kind == "UniformTypeKVCacheSpecs" and latent_with_indexer(spec):
            indexer = tuple(n for n in names if is_indexer(spec.kv_cache_specs[n]))
            groups.append(KvCacheGroup(index, names, latent=True, indexer_layers=indexer,
                                       indexer_head_size=int(spec.kv_cache_specs[indexer[0]].head_size)))
        elif kind in _SLIDING_SPECS and not getattr(spec, "extra_retained_tokens", 0):
            groups.append(KvCacheGroup(index, names, int(spec.sliding_window)))
        elif kind in _STATE_SPECS and getattr(spec, "mamba_cache_mode", "align") == "align":
            groups.append(KvCacheGroup(index, names, state_shapes=tuple(tuple(int(n) for n in s) for s in spec.shapes),
                                       state_dtypes=tuple(_dtype_name(d) for d in spec.dtypes)))
        else:
            mode = getattr(spec, "mamba_cache_mode", None)
            raise UnsupportedKvGroups(
                f"KV cache group {index} ({kind}{f' in mamba_cache_mode {mode!r}' if mode else ''}, layers "
                f"{names[0]}..) is not one the cache can store: only full-attention, MLA latent, sliding-window "
                "attention and state layers with prefix caching in 'align' mode are supported"
            )
    return tuple(groups)


def is_indexer(spec: Any) -> bool:
    """DeepSeek-V3.2's indexer keys: an ``MLAAttentionSpec`` whose ``cache_role`` is indexer (not a latent)."""
    return str(getattr(getattr(spec, "cache_role", ""), "value", "")) == "indexer"


def latent_with_indexer(spec: Any) -> bool:
    """A ``UniformTypeKVCacheSpecs`` of MLA latents and DeepSeek-V3.2 indexer keys of one width (both present)."""
    members = list((getattr(spec, "kv_cache_specs", None) or {}).values())
    indexer = [s for s in members if is_indexer(s)]
    return (all(type(s).__name__ in _MLA_SPECS for s in members) and 0 < len(indexer) < len(members)
            and len({int(s.head_size) for s in indexer}) == 1)


def _dtype_name(dtype: Any) -> str:
    """"float32" for torch.float32 (or the string itself): the form key tags and the worker's views use."""
    return str(dtype).removeprefix("torch.")


def is_single_full_group(groups: Sequence[KvCacheGroup]) -> bool:
    """One full-attention (or MLA) group: keys without a group tag, every layer in one chunk, loads in the step.

    Pre-hybrid keys were written under this layout and stay the same; an MLA model's keys differ from a
    standard one's by the worker's layout tag (kind ``mla``) in the key space.
    """
    return len(groups) == 1 and groups[0].kind in PREFIX_KINDS


def longest_hit_tokens(
    groups: Sequence[KvCacheGroup],
    num_chunks: int,
    chunk_size_tokens: int,
    block_size_tokens: int,
    max_tokens: int,
    held: Callable[[int, int], bool],
) -> int:
    """The longest block-aligned prefix every group can restore; 0 if none.

    ``num_chunks`` full chunks of the prompt have keys; ``held(group_index, chunk)``
    says whether every rank holds that group's chunk; ``max_tokens`` caps the hit
    (vLLM computes at least one prompt token). Full-attention groups need every
    chunk up to the hit (so do MLA groups); sliding-window groups only the chunks their window
    before the hit touches, so a prefix whose early chunks were evicted can
    still hit; state groups only the state at the hit, which therefore is a
    chunk boundary.
    """
    full = [g for g in groups if g.kind in PREFIX_KINDS]
    sliding = [g for g in groups if g.kind == SLIDING]
    state = [g for g in groups if g.kind == STATE]
    top = num_chunks
    for group in full:
        count = 0
        while count < top and held(group.index, count):
            count += 1
        top = count
    for chunks in range(top, 0, -1):
        hit = min(chunks * chunk_size_tokens, max_tokens)
        hit -= hit % block_size_tokens
        if hit <= 0 or (state and hit % chunk_size_tokens):
            continue
        if not all(held(group.index, hit // chunk_size_tokens - 1) for group in state):
            continue
        last_chunk = -(-hit // chunk_size_tokens)
        if all(
            held(group.index, c)
            for group in sliding
            for c in range(group.first_needed_block(hit, block_size_tokens) * block_size_tokens // chunk_size_tokens,
                           last_chunk)
        ):
            return hit
    return 0

"""The blending algorithm (CacheBlend-style), layer by layer over plain tensors.

Runs in the process that owns the model: the reference blender on CPU here,
and (later) the vLLM worker, which supplies the same per-layer pieces through
``LayerwiseModel``. Nothing here knows a model class.

``blend`` takes the exact KV of a prefix and, for each following segment, the
per-layer KV stored for it when it was computed alone at positions 0..n-1. It
re-rotates every cached K to the segment's new positions, recomputes all
blended tokens through the layers before the first check layer and the Q/K/V
of the check layer itself (those K/V are exact: their inputs are), then keeps
only the tokens whose fresh K deviates most from the cached one and carries
them through the remaining layers, attending causally over
[prefix | blended segments]. One check layer is run as gradual filtering
(``selection.gradual_schedule``: twice the count kept there, 1.5 times at the
next layer, the count from the one after). Every other token keeps its cached KV. With
ratio 1.0 this is exactly a prefill; with one segment at position 0 and ratio
0 it is exactly the cached KV. ``prefill`` then computes the tail (the
question) over the blended KV as vLLM would.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Protocol, Sequence

import torch

from lmi_cache.blend.attention import SegmentAttention, attend, attend_with_lse, merge_attention
from lmi_cache.blend.rope import RopeSpec, apply_rope, rerotate
from lmi_cache.blend.selection import gradual_schedule, kv_deviation, select_random, select_topk


class LayerwiseModel(Protocol):
    """The per-layer pieces of a Llama-family decoder that blending needs."""

    num_layers: int
    attn_scale: float
    rope: RopeSpec

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] input hidden states."""

    def qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normalised projections before RoPE: q [T, H, D], k and v [T, H_kv, D]."""

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP: layer input [T, hidden] + attention [T, H*D] -> layer output."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [T, hidden] -> [T, vocab]."""


# Tokens per slice when a layer's output projection and MLP run over many tokens (the first
# layers of a blend, a segment's own prefill): the MLP's intermediate of a slice stays near
# 10 MiB, memory the heap hands back slice after slice, instead of one buffer of hundreds of MiB
# that glibc maps fresh and faults in on every blend. Rows are independent in these ops.
FINISH_SLICE_TOKENS = 1024


def finish_rows(model: LayerwiseModel, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """``model.finish_layer`` over slices of at most ``FINISH_SLICE_TOKENS`` rows."""
    num_tokens = hidden.shape[0]
    if num_tokens <= FINISH_SLICE_TOKENS:
        return model.finish_layer(layer, hidden, attn)
    return torch.cat([model.finish_layer(layer, hidden[s : s + FINISH_SLICE_TOKENS], attn[s : s + FINISH_SLICE_TOKENS])
                      for s in range(0, num_tokens, FINISH_SLICE_TOKENS)])


def rotate_qk(model: LayerwiseModel, layer: int, q: torch.Tensor, k: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated to ``positions``: by the model's own RoPE kernel when it offers one (``rope_qk``), else ``apply_rope``.

    vLLM's fused in-place kernel is several times faster than the tensor arithmetic and gives the
    recomputed tokens exactly the values vLLM's own forward gives them; ``model.rope`` stays the
    spec that cached K is re-rotated with (the same angles).
    """
    own = getattr(model, "rope_qk", None)
    if own is not None:
        return own(layer, q, k, positions)
    return apply_rope(q, positions, model.rope), apply_rope(k, positions, model.rope)


class LayerAttention(Protocol):
    """Attention of one layer's queries over [prefix | blended tokens]: (layer, q, positions, k, v) -> [Tq, H*D].

    ``k``/``v`` are the layer's blended tokens' K/V (after the prefix); the prefix is the implementation's to find.
    """

    def __call__(self, layer: int, q: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor: ...


class CrossAttention(Protocol):
    """Attention of queries to the keys at positions <= a limit each, with its log-sum-exp: (layer, q, limits, k, v) -> ([Tq, H*D], [Tq, H]).

    ``k``/``v`` are the layer's blended tokens' K/V, as for ``LayerAttention``; limits are
    absolute positions (the prefix counts).
    """

    def __call__(self, layer: int, q: torch.Tensor, limits: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class KVStack:
    """Per-layer KV of consecutive tokens: k and v of shape [layers, T, H_kv, D], K after RoPE."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    def cat(self, other: "KVStack") -> "KVStack":
        return KVStack(torch.cat((self.k, other.k), dim=1), torch.cat((self.v, other.v), dim=1))


@dataclass(frozen=True)
class BlendOutcome:
    """KV of [prefix | blended segments] and which blended tokens were recomputed past the check layers."""

    kv: KVStack
    recomputed: torch.Tensor  # indices into the blended tokens (0 = first token after the prefix), ascending


def empty_kv(like: KVStack) -> KVStack:
    """KV of zero tokens with ``like``'s layers, heads, head size and dtype."""
    return KVStack(like.k[:, :0], like.v[:, :0])


def prefill(
    model: LayerwiseModel, token_ids: torch.Tensor, past: KVStack | None = None,
    attention: LayerAttention | None = None,
) -> tuple[KVStack, torch.Tensor]:
    """Ordinary prefill of ``token_ids`` after ``past`` (positions continue from it).

    Returns the new tokens' KV and their final hidden states [T, hidden]. ``attention``
    as in ``blend`` (it gets the new tokens' K/V; ``past`` is the implementation's to find).
    """
    start = 0 if past is None else past.num_tokens
    positions = torch.arange(start, start + token_ids.numel())
    all_positions = torch.arange(start + token_ids.numel())
    hidden = model.embed(token_ids)
    new_k: list[torch.Tensor] = []
    new_v: list[torch.Tensor] = []
    for layer in range(model.num_layers):
        q, k, v = model.qkv(layer, hidden)
        q, k = rotate_qk(model, layer, q, k, positions)
        new_k.append(k)
        new_v.append(v)
        if attention is not None:
            attn = attention(layer, q, positions, k, v)
        else:
            full_k = k if past is None else torch.cat((past.k[layer], k))
            full_v = v if past is None else torch.cat((past.v[layer], v))
            attn = attend(q, full_k, full_v, positions, all_positions, model.attn_scale)
        hidden = finish_rows(model, layer, hidden, attn)
    return KVStack(torch.stack(new_k), torch.stack(new_v)), hidden


def segment_kv(model: LayerwiseModel, token_ids: torch.Tensor, attention: LayerAttention | None = None) -> KVStack:
    """The KV stored for a segment: computed alone, at positions 0..n-1."""
    return prefill(model, token_ids, attention=attention)[0]


def rerotated_segments(model: LayerwiseModel, cached: Sequence[KVStack | None], lengths: Sequence[int],
                       start: int) -> KVStack:
    """Cached segment KVs laid end to end from position ``start``, every layer's K re-rotated.

    A segment without cached KV (None) gets zeros: the blender recomputes all of its tokens.
    """
    like = next((seg for seg in cached if seg is not None), None)
    if like is None:
        raise ValueError("at least one segment must have cached KV")
    num_layers, heads, dim = like.k.shape[0], like.k.shape[2], like.k.shape[3]
    out_k = like.k.new_empty((num_layers, sum(lengths), heads, dim))
    out_v = like.v.new_empty((num_layers, sum(lengths), heads, dim))
    offset = 0
    for seg, n in zip(cached, lengths):
        if seg is None:
            out_k[:, offset : offset + n] = 0
            out_v[:, offset : offset + n] = 0
        else:
            if seg.num_tokens != n:
                raise ValueError(f"cached KV holds {seg.num_tokens} tokens, its segment {n}")
            old = torch.arange(n)
            # Every layer in one pass, written straight into place (no per-layer copies).
            rerotate(seg.k, old, old + start + offset, model.rope, out=out_k[:, offset : offset + n])
            out_v[:, offset : offset + n] = seg.v
        offset += n
    return KVStack(out_k, out_v)


def blend(
    model: LayerwiseModel,
    prefix_kv: KVStack,
    segment_tokens: Sequence[torch.Tensor],
    cached: Sequence[KVStack | None],
    check_layers: Sequence[int],
    recompute_counts: Sequence[int],
    selection: Literal["topk", "random"] = "topk",
    deviation: Literal["k", "kv"] = "k",
    generator: torch.Generator | None = None,
    attention: LayerAttention | None = None,
    include_prefix: bool = True,
    layer0_within: Sequence[SegmentAttention | None] | None = None,
    cross_attention: CrossAttention | None = None,
    gradual: bool = True,
) -> BlendOutcome:
    """Blend cached segments after an exact prefix; see the module docstring.

    ``attention`` replaces the reference attention (e.g. vLLM's kernel over the
    paged cache); it gets the layer's whole blended K/V so far, fresh and cached.
    ``include_prefix=False`` returns the blended tokens' KV only (saves copying the prefix).

    ``cached[i]`` is segment i's stored KV, or None when it is not cached: its tokens are then
    computed in full (never deselected). ``recompute_counts[i]`` cached tokens stay in the
    recompute set after ``check_layers[i]``; each check selects among those the previous one kept.
    A single check layer becomes gradual filtering (``selection.gradual_schedule``) unless
    ``gradual=False`` (one check keeping the count: the ablation's baseline).

    ``layer0_within[i]``, segment i's layer-0 attention over itself (``layer0_reuse``), lets
    layer 0 attend its tokens only to what precedes the segment (``cross_attention``, else the
    reference) and merge; see ``_layer0_reuse`` for when it is taken.
    """
    if len(segment_tokens) != len(cached) or not cached:
        raise ValueError("give the token ids and the cached KV (or None) of each segment (at least one)")
    if len(check_layers) != len(recompute_counts):
        raise ValueError("one recompute count per check layer")
    if gradual:
        check_layers, recompute_counts = gradual_schedule(check_layers, recompute_counts, model.num_layers)
    tokens = torch.cat(list(segment_tokens))
    start = prefix_kv.num_tokens
    positions = torch.arange(start, start + tokens.numel())
    all_positions = torch.arange(start + tokens.numel())
    cached_kv = rerotated_segments(model, cached, [int(t.numel()) for t in segment_tokens], start)
    forced = torch.cat([torch.full((int(t.numel()),), c is None) for t, c in zip(segment_tokens, cached)])
    counts = dict(zip(check_layers, recompute_counts))
    # Fresh K/V overwrite the cached ones in place; only the check layers' cached values are
    # compared afterwards, so only those are kept aside (copying every layer cost more than the matmuls).
    check_cached = {layer: KVStack(cached_kv.k[layer].clone(), cached_kv.v[layer].clone())
                    for layer in counts if layer < model.num_layers}
    out_k, out_v = cached_kv.k, cached_kv.v
    active = torch.arange(tokens.numel())
    everyone = True  # active is still every blended token: rows are written by slice, not by index
    pos = positions  # one tensor per selection: the attention may plan once for all layers that share it
    reuse = _layer0_reuse(segment_tokens, cached, layer0_within, start, counts, forced, model.num_layers)
    hidden = model.embed(tokens)
    for layer in range(model.num_layers):
        if active.numel() == 0:
            break
        q, k, v = model.qkv(layer, hidden)
        q, k = rotate_qk(model, layer, q, k, pos)
        if everyone:
            out_k[layer].copy_(k)
            out_v[layer].copy_(v)
        else:
            out_k[layer, active] = k
            out_v[layer, active] = v
        if layer in counts:
            keep = _select(
                k, v, check_cached[layer], active, forced[active], counts[layer], selection, deviation, generator
            )
            active, q, hidden, pos = active[keep], q[keep], hidden[keep], pos[keep]
            everyone = False
            if active.numel() == 0:
                break
        def attend_layer(q: torch.Tensor, pos: torch.Tensor, layer: int = layer) -> torch.Tensor:
            if attention is not None:
                return attention(layer, q, pos, out_k[layer], out_v[layer])
            full_k = torch.cat((prefix_kv.k[layer], out_k[layer]))
            full_v = torch.cat((prefix_kv.v[layer], out_v[layer]))
            return attend(q, full_k, full_v, pos, all_positions, model.attn_scale)

        if layer == 0 and reuse is not None:
            attn = _layer0_attention(model, prefix_kv, q, pos, out_k[0], out_v[0], reuse, attend_layer,
                                     cross_attention)
        else:
            attn = attend_layer(q, pos)
        hidden = finish_rows(model, layer, hidden, attn)
    blended = KVStack(out_k, out_v)
    return BlendOutcome(prefix_kv.cat(blended) if include_prefix else blended, active)


@dataclass(frozen=True)
class _Layer0Reuse:
    rows: torch.Tensor    # blended-token indices whose layer-0 attention is merged, ascending
    limits: torch.Tensor  # per row: the last position before its segment
    within: SegmentAttention  # those rows' attention over their own segment, concatenated


def _layer0_reuse(segment_tokens: Sequence[torch.Tensor], cached: Sequence[KVStack | None],
                  within: Sequence[SegmentAttention | None] | None, start: int, counts: dict[int, int],
                  forced: torch.Tensor, num_layers: int) -> _Layer0Reuse | None:
    """The rows whose layer-0 attention comes from their segment's stored attention, or None.

    Only when layer 0 runs for every token (no check at layer 0) and the first check
    deselects someone: a blend that keeps everyone (ratio 1.0) must equal a prefill exactly,
    and the merge differs from it in the last bits. A segment needs its stored attention and
    its KV, and something before it (at position 0 the stored attention is the whole
    attention; computing it as a prefill keeps such a blend exact at ratio 0).
    """
    if within is None or len(within) != len(segment_tokens):
        return None
    checks = [layer for layer in counts if layer < num_layers]
    if not checks or min(checks) == 0 or counts[min(checks)] >= int((~forced).sum()):
        return None
    rows: list[torch.Tensor] = []
    limits: list[torch.Tensor] = []
    parts: list[SegmentAttention] = []
    offset = 0
    for tokens, kv, att in zip(segment_tokens, cached, within):
        n = int(tokens.numel())
        if kv is not None and att is not None and att.num_tokens == n and start + offset > 0:
            rows.append(torch.arange(offset, offset + n))
            limits.append(torch.full((n,), start + offset - 1, dtype=torch.long))
            parts.append(att)
        offset += n
    if not rows:
        return None
    return _Layer0Reuse(torch.cat(rows), torch.cat(limits),
                        SegmentAttention(torch.cat([p.out for p in parts]), torch.cat([p.lse for p in parts])))


def _layer0_attention(model: LayerwiseModel, prefix_kv: KVStack, q: torch.Tensor, pos: torch.Tensor,
                      k_blended: torch.Tensor, v_blended: torch.Tensor, reuse: _Layer0Reuse,
                      attend_layer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      cross_attention: CrossAttention | None) -> torch.Tensor:
    """Layer 0's attention [T, H*D] of every blended token: reused rows by merge, the rest as usual."""
    rows = reuse.rows
    if cross_attention is not None:
        cross_out, cross_lse = cross_attention(0, q[rows], reuse.limits, k_blended, v_blended)
    else:
        cross_out, cross_lse = attend_with_lse(q[rows], torch.cat((prefix_kv.k[0], k_blended)),
                                               torch.cat((prefix_kv.v[0], v_blended)), reuse.limits, model.attn_scale)
    merged = merge_attention(cross_out, cross_lse, reuse.within.out.reshape(rows.numel(), -1).to(cross_out.dtype),
                             reuse.within.lse)
    if rows.numel() == q.shape[0]:
        return merged
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[rows] = False
    rest = torch.nonzero(others).flatten()
    attn = merged.new_empty((q.shape[0], merged.shape[1]))
    attn[rows] = merged
    attn[rest] = attend_layer(q[rest], pos[rest]).to(merged.dtype)
    return attn


def _select(
    k: torch.Tensor,
    v: torch.Tensor,
    cached: KVStack,
    active: torch.Tensor,
    forced: torch.Tensor,
    count: int,
    selection: Literal["topk", "random"],
    deviation: Literal["k", "kv"],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Positions within ``active`` that stay: every forced one plus ``count`` chosen among the rest."""
    candidates = torch.nonzero(~forced).flatten()
    if selection == "topk":
        with_v = deviation == "kv"
        scores = kv_deviation(
            k[candidates],
            cached.k[active[candidates]],
            v[candidates] if with_v else None,
            cached.v[active[candidates]] if with_v else None,
        )
        chosen = select_topk(scores, count)
    else:
        if generator is None:
            raise ValueError("random selection needs a seeded torch.Generator")
        chosen = select_random(candidates.numel(), count, generator)
    if not bool(forced.any()):
        return candidates[chosen]
    return torch.sort(torch.cat((torch.nonzero(forced).flatten(), candidates[chosen]))).values


def naive_concat(model: LayerwiseModel, prefix_kv: KVStack, cached: Sequence[KVStack]) -> KVStack:
    """The baseline with no recompute at all: cached segment KV re-rotated and appended to the prefix."""
    return prefix_kv.cat(rerotated_segments(model, cached, [c.num_tokens for c in cached], prefix_kv.num_tokens))


def next_token_logits(model: LayerwiseModel, context: KVStack, tail_ids: torch.Tensor) -> torch.Tensor:
    """Prefill the tail over ``context`` and return the logits after its last token [vocab]."""
    _, hidden = prefill(model, tail_ids, context)
    return model.logits(hidden[-1:])[0]

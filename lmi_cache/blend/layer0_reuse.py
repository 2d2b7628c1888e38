"""Layer 0's attention of a segment over itself: stored beside the segment's KV, reused by every blend of it.

A blend runs the layers before its first check layer over every blended token,
and layer 0's attention over the whole prompt is the largest single piece of a
blend (a quarter of it on an 8-layer model). But layer 0's input is the token
embedding, which knows no context, and with RoPE a query's score against a key
depends only on their distance. So the part of a token's layer-0 attention that
falls inside its own segment is the same wherever the segment sits: it is what
the segment's own prefill computed. Stored once per segment as each row's output
and log-sum-exp, it lets a blend compute only each token's attention to the
tokens before its segment (the prefix and earlier segments) and merge the two
by their log-sum-exps (``attention.merge_attention``). For 4 documents of 2,000
tokens that skips a quarter of layer 0's attention.

The merged result equals the full attention up to float rounding, not bit for
bit, so blends that must equal a prefill exactly do not use it: the blender
takes it only when its first check layer deselects tokens (not at ratio 1.0),
and never for a segment with nothing before it.

Stored as its own engine object ``[T, H, D + 1]`` float32 (output, then the
log-sum-exp in the last column) under a key derived from the segment's key:
the segment's KV object keeps its layout, and a blend whose segment has no such
object (evicted, stored by an older version, another device) computes layer 0
in full.
"""
from __future__ import annotations

from typing import Callable

import torch

from lmi_cache.blend.attention import SegmentAttention, attend
from lmi_cache.blend.blender import KVStack, LayerAttention, LayerwiseModel, segment_kv
from lmi_cache.blend.jobs import attention_key

__all__ = ["attention_key", "pack", "packed_shape", "segment_kv_and_attention", "unpack"]


# (q [T, H, D] after RoPE, causal limits [T], k [T, H_kv, D], v, scale) -> (out [T, H*D], lse [T, H])
AttendWithLse = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                         tuple[torch.Tensor, torch.Tensor]]


def segment_kv_and_attention(model: LayerwiseModel, token_ids: torch.Tensor, attention: LayerAttention | None,
                             attend_with_lse: AttendWithLse) -> tuple[KVStack, SegmentAttention]:
    """``blender.segment_kv`` of ``token_ids`` and its layer-0 attention over itself, from the same forward.

    The stored KV still comes from ``attention`` (vLLM's kernel in the worker, so a blend at
    ratio 1.0 stays exact); ``attend_with_lse`` additionally gives layer 0's rows and their
    log-sum-exps from the same Q/K/V.
    """
    found: list[SegmentAttention] = []

    def hook(layer: int, q: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer == 0:
            out, lse = attend_with_lse(q, positions, k, v, model.attn_scale)
            found.append(SegmentAttention(out.reshape(q.shape).float(), lse.float()))
        if attention is not None:
            return attention(layer, q, positions, k, v)
        return attend(q, k, v, positions, positions, model.attn_scale)  # alone: the keys are these tokens

    kv = segment_kv(model, token_ids, hook)
    return kv, found[0]


def pack(att: SegmentAttention, out: torch.Tensor) -> None:
    """Write ``att`` into an engine buffer of shape ``packed_shape``."""
    dim = att.out.shape[2]
    out[..., :dim].copy_(att.out)
    out[..., dim].copy_(att.lse)


def packed_shape(num_tokens: int, num_heads: int, head_dim: int) -> tuple[int, int, int]:
    return (num_tokens, num_heads, head_dim + 1)


def unpack(data: torch.Tensor | None, num_tokens: int, num_heads: int, head_dim: int) -> SegmentAttention | None:
    """The stored object as a ``SegmentAttention``, or None when missing or not of this segment's shape."""
    if data is None or tuple(data.shape) != packed_shape(num_tokens, num_heads, head_dim):
        return None
    data = data.float()
    return SegmentAttention(data[..., :head_dim], data[..., head_dim])

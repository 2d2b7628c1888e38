"""Causal attention over explicit token positions (pure torch), for blending and its reference model.

Runs wherever blending runs. Queries are any subset of a prompt's tokens and
keys are all tokens so far; the causal rule is by position (a query at
position p sees keys at positions <= p), so the same function serves a full
prefill, a prefill with cached context, and a blend that recomputes a few
scattered tokens over [prefix | blended segments].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_SLICE_TOKENS = 512


def causal_mask(q_positions: torch.Tensor, kv_positions: torch.Tensor) -> torch.Tensor:
    """Boolean [Tq, Tk]: True where the query may attend to the key."""
    return kv_positions[None, :] <= q_positions[:, None]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention output [Tq, heads * head_dim] for q [Tq, H, D] over k, v [Tk, H_kv, D] (GQA allowed)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    k_t, v_t = k.transpose(0, 1), v.transpose(0, 1)
    outs: list[torch.Tensor] = []
    # Queries in slices: the [heads, Tq, Tk] scores of an 8k-token prompt at once would take gigabytes.
    for start in range(0, q.shape[0], QUERY_SLICE_TOKENS):
        end = min(start + QUERY_SLICE_TOKENS, q.shape[0])
        mask = causal_mask(q_positions[start:end], kv_positions)
        out = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k_t, v_t, attn_mask=mask[None], scale=scale)
        outs.append(out.transpose(0, 1).reshape(end - start, -1))
    if not outs:
        return q.new_zeros((0, q.shape[1] * q.shape[2]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)

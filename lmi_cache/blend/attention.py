"""Causal attention over explicit token positions (pure torch), for blending and its reference model.

Runs wherever blending runs. Queries are any subset of a prompt's tokens and
keys are all tokens so far; the causal rule is by position (a query at
position p sees keys at positions <= p), so the same function serves a full
prefill, a prefill with cached context, and a blend that recomputes a few
scattered tokens over [prefix | blended segments].
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class SegmentAttention:
    """Attention of a segment's tokens over the segment alone: out [T, H, D] and lse [T, H] (float32).

    What ``blend`` merges with the tokens' attention to what precedes their segment
    (``layer0_reuse`` stores it for layer 0).
    """

    out: torch.Tensor
    lse: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.out.shape[0])


def attend_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    limits: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention [Tq, H*D] of q [Tq, H, D] over the keys at positions <= ``limits`` (k, v from position 0), and its log-sum-exp [Tq, H].

    ``limits`` is only a causal limit per query (RoPE is already in q), so queries may share
    one: the attention of a segment's tokens to everything before the segment. The
    log-sum-exp of the scaled scores lets it be merged with attention over other keys
    (``merge_attention``).
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k_h = k.repeat_interleave(group, dim=1) if group > 1 else k
    v_h = v.repeat_interleave(group, dim=1) if group > 1 else v
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    key_positions = torch.arange(k.shape[0])
    for start in range(0, q.shape[0], QUERY_SLICE_TOKENS):
        end = min(start + QUERY_SLICE_TOKENS, q.shape[0])
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k_h.float()) * scale
        scores = scores.masked_fill(~causal_mask(limits[start:end], key_positions)[None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, q]
        out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), v_h.float())
        outs.append(out.reshape(end - start, -1).to(q.dtype))
        lses.append(lse.transpose(0, 1))
    if not outs:
        return q.new_zeros((0, num_heads * q.shape[2])), q.new_zeros((0, num_heads), dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each one's output [T, H*D] and log-sum-exp [T, H].

    Softmax weights over the union are each part's weights times its share of the total
    mass, e^lse_a / (e^lse_a + e^lse_b) = sigmoid(lse_a - lse_b).
    """
    num_tokens, num_heads = lse_a.shape
    share_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1).to(out_a.dtype)  # [T, H, 1]
    a = out_a.reshape(num_tokens, num_heads, -1)
    b = out_b.reshape(num_tokens, num_heads, -1)
    return (b + share_a * (a - b)).reshape(num_tokens, -1)

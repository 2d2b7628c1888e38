"""A plain-torch reference of the published CacheBlend algorithm, for the quality benchmark and the tests only.

Runs on CPU in ``bench_blend_quality.py`` and the blend quality tests; nothing in
``lmi_cache`` imports it. Written from the algorithm's published description,
independently of ``lmi_cache.blend.blender``, so that the two can be compared
piece by piece:

* each document's KV is computed alone, from position 0, and kept before RoPE;
  placing it later in a prompt rotates it to its new positions (the same
  rotation a re-rotation of the post-RoPE K composes);
* the layers before the first check layer are computed in full for every
  blended token (layer 0's input is the embedding, so its KV needs no fixing);
* at a check layer every remaining token's K and V are computed, the tokens
  whose fresh KV deviates most from the cached one (squared L2 over K, or K and
  V) are kept, and each later check keeps fewer of those ("gradual filtering");
* a kept token is recomputed through every later layer, attending causally to
  the exact prefix, the cached KV of the tokens not kept and the fresh KV of
  those kept; every other token keeps its cached KV.

Works on a transformers ``LlamaForCausalLM`` with default RoPE (the test and
benchmark models); it walks the model's modules itself and never calls
``forward``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch


@dataclass
class RefKV:
    """Per-layer K before RoPE and V, each a list of [T, H_kv, D] tensors, plus the positions K is to be rotated to."""

    k_raw: list[torch.Tensor]
    v: list[torch.Tensor]
    positions: torch.Tensor


class ReferenceLlama:
    """Layer-by-layer forward of a transformers Llama with explicit positions and RoPE."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        self.layers = model.model.layers
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        theta = float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] turned by RoPE to ``positions`` (angles in float64, then the input's dtype)."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos().to(x.dtype)[:, None, :], angles.sin().to(x.dtype)[:, None, :]
        lo, hi = x[..., : self.dim // 2], x[..., self.dim // 2 :]
        return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1)

    def project(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        block = self.layers[layer]
        x = block.input_layernorm(hidden)
        att = block.self_attn
        return (att.q_proj(x).view(-1, self.heads, self.dim), att.k_proj(x).view(-1, self.kv_heads, self.dim),
                att.v_proj(x).view(-1, self.kv_heads, self.dim))

    def attention(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_pos: torch.Tensor) -> torch.Tensor:
        """Causal softmax attention by position: q [Tq, H, D] (rotated) over k (rotated), v [Tk, H_kv, D]."""
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / self.dim**0.5
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).reshape(q.shape[0], self.heads * self.dim)

    def finish(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        hidden = hidden + block.self_attn.o_proj(attn)
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def prefill(self, ids: torch.Tensor, past: RefKV | None = None) -> tuple[RefKV, torch.Tensor]:
        """KV of ``ids`` placed after ``past`` (or at 0) and their last hidden states."""
        start = 0 if past is None else int(past.positions[-1]) + 1
        pos = torch.arange(start, start + ids.numel())
        hidden = self.model.model.embed_tokens(ids)
        out = RefKV([], [], pos)
        for layer in range(len(self.layers)):
            q, k, v = self.project(layer, hidden)
            all_k = k if past is None else torch.cat((past.k_raw[layer], k))
            all_v = v if past is None else torch.cat((past.v[layer], v))
            all_pos = pos if past is None else torch.cat((past.positions, pos))
            attn = self.attention(self.rotate(q, pos), pos, self.rotate(all_k, all_pos), all_v, all_pos)
            out.k_raw.append(k)
            out.v.append(v)
            hidden = self.finish(layer, hidden, attn)
        return out, hidden

    def next_token_logits(self, context: RefKV, tail: torch.Tensor) -> torch.Tensor:
        _, hidden = self.prefill(tail, context)
        return self.model.lm_head(self.model.model.norm(hidden[-1:]))[0]


def cat_kv(a: RefKV, b: RefKV) -> RefKV:
    return RefKV([torch.cat(x) for x in zip(a.k_raw, b.k_raw)], [torch.cat(x) for x in zip(a.v, b.v)],
                 torch.cat((a.positions, b.positions)))


def reference_blend(ref: ReferenceLlama, prefix: torch.Tensor, segments: Sequence[torch.Tensor],
                    keep: Mapping[int, int], deviation: Literal["k", "kv"] = "k",
                    check_layer_all_fresh: bool = True) -> tuple[RefKV, torch.Tensor]:
    """KV of [prefix | segments] by selective recompute, and the kept (recomputed) token indices.

    ``keep`` maps each check layer to how many blended tokens stay recomputed after it
    (one entry: a single check; several, decreasing: gradual filtering).
    ``check_layer_all_fresh``: at a check layer every token computed there keeps its fresh KV
    (else only the kept ones do; the others get the cached KV there too).
    """
    prefix_kv, _ = ref.prefill(prefix)
    start = prefix.numel()
    cached = [ref.prefill(s)[0] for s in segments]
    body = torch.cat(list(segments))
    pos = torch.arange(start, start + body.numel())
    k_layers = [torch.cat([c.k_raw[layer] for c in cached]) for layer in range(len(ref.layers))]
    v_layers = [torch.cat([c.v[layer] for c in cached]) for layer in range(len(ref.layers))]
    active = torch.arange(body.numel())
    hidden = ref.model.model.embed_tokens(body)
    for layer in range(len(ref.layers)):
        if active.numel() == 0:
            break
        q, k, v = ref.project(layer, hidden)
        if layer in keep:
            score = (k - k_layers[layer][active]).pow(2).flatten(1).sum(1)
            if deviation == "kv":
                score = score + (v - v_layers[layer][active]).pow(2).flatten(1).sum(1)
            chosen = torch.sort(torch.argsort(score, descending=True, stable=True)[: keep[layer]]).values
            if check_layer_all_fresh:
                k_layers[layer][active], v_layers[layer][active] = k, v
            active, q, k, v, hidden = active[chosen], q[chosen], k[chosen], v[chosen], hidden[chosen]
            if active.numel() == 0:
                break
        k_layers[layer][active], v_layers[layer][active] = k, v
        all_pos = torch.cat((prefix_kv.positions, pos))
        all_k = ref.rotate(torch.cat((prefix_kv.k_raw[layer], k_layers[layer])), all_pos)
        all_v = torch.cat((prefix_kv.v[layer], v_layers[layer]))
        attn = ref.attention(ref.rotate(q, pos[active]), pos[active], all_k, all_v, all_pos)
        hidden = ref.finish(layer, hidden, attn)
    return cat_kv(prefix_kv, RefKV(k_layers, v_layers, pos)), active

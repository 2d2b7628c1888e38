"""A Hugging Face transformers Llama/Qwen2/Qwen3/Mistral model seen as a ``LayerwiseModel``.

Runs in the reference blender, the quality benchmarks and the tests (CPU).
The thin layer between ``blender`` (plain tensors) and transformers' module
names; the vLLM worker will supply its own adapter over vLLM's modules.
"""
from __future__ import annotations

from typing import Any

import torch

from lmi_cache.blend.rope import RopeSpec
from lmi_cache.blend.support import check_blendable


class HFLayerwiseModel:
    """Per-layer pieces of a transformers ``*ForCausalLM`` (weights shared, not copied)."""

    def __init__(self, model: Any) -> None:
        config = model.config.to_dict()
        self.rope: RopeSpec = check_blendable(config, getattr(model.config, "name_or_path", "") or "the model")
        self._model = model
        self._layers = model.model.layers
        self.num_layers = len(self._layers)
        self.head_dim = self.rope.head_dim
        self.num_heads = int(model.config.num_attention_heads)
        self.num_kv_heads = int(getattr(model.config, "num_key_value_heads", None) or self.num_heads)
        self.attn_scale = self.head_dim**-0.5

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._model.model.embed_tokens(token_ids)

    def qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        block = self._layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        # Head counts spelled out: a view with -1 cannot size zero tokens (an empty prefix).
        q = attn.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        block = self._layers[layer]
        hidden = hidden + block.self_attn.o_proj(attn)
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._model.lm_head(self._model.model.norm(hidden))

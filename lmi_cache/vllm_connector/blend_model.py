"""vLLM's own Llama-family modules seen as the blender's ``LayerwiseModel`` (vLLM worker process).

The blender needs each decoder layer in pieces (norm + QKV projections; output
projection + residual + MLP) so it can run scattered tokens through a layer
with its own attention over [prefix | blended segments]. vLLM's
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` share the module names used here (``model.layers[i]``
with ``input_layernorm``, ``self_attn.qkv_proj`` / ``o_proj`` (and
``q_norm``/``k_norm`` on Qwen3), ``post_attention_layernorm``, ``mlp``), so one
adapter covers them; the weights are vLLM's, not a copy. RoPE comes from the
model's config (``rope.RopeSpec``), the same angles vLLM uses.

The worker finds the loaded model through ``plugin`` (a vLLM general
plugin that records it when vLLM loads it) or, without the plugin, by finding
the module that owns the attention layers vLLM registered.
"""
from __future__ import annotations

import gc
import logging
import warnings
from typing import Any, Mapping

import torch

from lmi_cache.blend.rope import RopeSpec
from lmi_cache.blend.support import check_blendable

logger = logging.getLogger(__name__)


class VllmLayerwiseModel:
    """Per-layer pieces of a vLLM Llama-family ``*ForCausalLM`` on this rank (TP slices included)."""

    def __init__(self, model: Any, hf_config: Mapping[str, Any], name: str = "the model") -> None:
        self.rope: RopeSpec = check_blendable(hf_config, name)
        self._layers = model.model.layers
        self._embed = model.model.embed_tokens
        self.num_layers = len(self._layers)
        first = self._layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self._q_size, self._kv_size = int(first.q_size), int(first.kv_size)
        self.attn_scale = float(getattr(first, "scaling", self.head_dim**-0.5))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._embed(token_ids.to(self._embed.weight.device))

    def qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        block = self._layers[layer]
        attn = block.self_attn
        qkv, _ = attn.qkv_proj(block.input_layernorm(hidden))
        q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        q = q.reshape(q.shape[0], -1, self.head_dim)
        k = k.reshape(k.shape[0], -1, self.head_dim)
        v = v.reshape(v.shape[0], -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
            q, k = attn.q_norm(q.contiguous()), attn.k_norm(k.contiguous())
        return q, k, v

    def rope_qk(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, H_kv, D] rotated to ``positions`` by the layer's own vLLM rotary op (in place).

        The values vLLM's forward gives the same tokens, from one fused call instead of several
        full passes of tensor arithmetic.
        """
        rotary = self._layers[layer].self_attn.rotary_emb
        num_tokens = q.shape[0]
        q2, k2 = rotary(positions.to(device=q.device, dtype=torch.long), q.reshape(num_tokens, -1),
                        k.reshape(num_tokens, -1))
        return q2.reshape(q.shape), k2.reshape(k.shape)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        block = self._layers[layer]
        out, _ = block.self_attn.o_proj(attn.to(hidden.dtype).contiguous())
        hidden = hidden + out
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("vLLM computes the logits itself after the blend")


def find_model(attention_layer: Any) -> Any | None:
    """The loaded vLLM model: the plugin's record, else the module whose layer 0 owns ``attention_layer``."""
    from lmi_cache.vllm_connector import plugin

    model = plugin.loaded_model()
    if model is not None:
        return model
    if attention_layer is None:
        return None
    with warnings.catch_warnings():  # isinstance on some gc objects touches deprecated torch attributes
        warnings.simplefilter("ignore")
        modules = [obj for obj in gc.get_objects() if isinstance(obj, torch.nn.Module)]
    for obj in modules:
        inner = getattr(obj, "model", None)
        layers = getattr(inner, "layers", None)
        try:
            if layers is not None and len(layers) and getattr(layers[0].self_attn, "attn", None) is attention_layer:
                logger.info("lmi-cache: blending found the model without the plugin (%s)", type(obj).__name__)
                return obj
        except (AttributeError, TypeError, IndexError):
            continue
    return None

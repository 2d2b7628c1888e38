"""Model KV geometry -> bytes per token, per rank and per chunk (torch-free).

Used by autoconfig (planning, in the container-start process) and by the engine
(chunk sizing, in the vLLM worker process). Pure arithmetic, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# Bytes per element of each KV dtype, as vLLM names them after resolution.
KV_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
}


@dataclass(frozen=True)
class SideCache:
    """A per-layer cache vLLM allocates beside the attention KV, one entry per token.

    DeepSeek-V3.2's indexer keys are one: ``index_head_dim`` fp8 values plus a
    float32 scale per 128 of them, stored as uint8 (132 B per token per layer),
    one copy per TP rank (vLLM's spec says ``num_kv_heads=1, max_tp_shards=1``).
    Its bytes do not follow ``--kv-cache-dtype``.
    """

    name: str  # what it is, for explanations ("indexer keys")
    num_layers: int  # layers that hold one
    bytes_per_token_per_layer: int

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer

    def bytes_per_token_per_rank(self, pp: int) -> int:
        """The fullest pipeline stage's share, replicated on every TP rank."""
        return math.ceil(self.num_layers / pp) * self.bytes_per_token_per_layer


@dataclass(frozen=True)
class KvLayout:
    """What one token costs in the KV cache, for the whole model.

    For standard attention (MHA/GQA/MQA) each attention layer stores a K and a V
    vector of ``head_dim`` per KV head. For MLA (DeepSeek V2/V3) each layer
    stores one latent of ``latent_dim`` (= kv_lora_rank + qk_rope_head_dim) and
    that latent is replicated on every tensor-parallel rank. ``side_caches``
    are the other per-token caches vLLM allocates per layer (DeepSeek-V3.2's
    indexer keys); every byte count below includes them.
    """

    num_layers: int  # layers that hold KV (attention layers only)
    num_kv_heads: int  # whole model, before the TP split (1 for MLA)
    head_dim: int  # per KV head; for MLA the latent dim
    kv_dtype: str  # a key of KV_DTYPE_BYTES
    is_mla: bool = False
    model_name: str = ""
    side_caches: tuple[SideCache, ...] = ()

    @property
    def dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes per token for the whole model (all layers, all heads)."""
        return self.attention_bytes_per_token + sum(side.bytes_per_token for side in self.side_caches)

    @property
    def attention_bytes_per_token(self) -> int:
        """The attention layers' K and V (or MLA latent) alone, without side caches."""
        per_layer = self.head_dim * self.dtype_bytes
        if self.is_mla:
            return self.num_layers * per_layer
        return self.num_layers * 2 * self.num_kv_heads * per_layer

    def kv_heads_per_rank(self, tp: int) -> int:
        """vLLM gives each TP rank total//tp KV heads, replicating when tp > heads."""
        if self.is_mla:
            return 1
        return max(1, self.num_kv_heads // tp)

    def layers_per_rank(self, pp: int) -> int:
        """The largest pipeline stage's layer count (what the fullest rank stores)."""
        return math.ceil(self.num_layers / pp)

    def kv_bytes_per_token_per_rank(self, tp: int = 1, pp: int = 1) -> int:
        """Bytes one TP/PP rank stores per token (the fullest rank)."""
        per_layer = self.head_dim * self.dtype_bytes
        layers = self.layers_per_rank(pp)
        sides = sum(side.bytes_per_token_per_rank(pp) for side in self.side_caches)
        if self.is_mla:
            return layers * per_layer + sides
        return layers * 2 * self.kv_heads_per_rank(tp) * per_layer + sides

    def chunk_bytes_per_rank(self, chunk_tokens: int, tp: int = 1, pp: int = 1) -> int:
        return chunk_tokens * self.kv_bytes_per_token_per_rank(tp, pp)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

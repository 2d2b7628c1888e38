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
class KvLayout:
    """What one token costs in the KV cache, for the whole model.

    For standard attention (MHA/GQA/MQA) each attention layer stores a K and a V
    vector of ``head_dim`` per KV head. For MLA (DeepSeek V2/V3) each layer
    stores one latent of ``latent_dim`` (= kv_lora_rank + qk_rope_head_dim) and
    that latent is replicated on every tensor-parallel rank.
    """

    num_layers: int  # layers that hold KV (attention layers only)
    num_kv_heads: int  # whole model, before the TP split (1 for MLA)
    head_dim: int  # per KV head; for MLA the latent dim
    kv_dtype: str  # a key of KV_DTYPE_BYTES
    is_mla: bool = False
    model_name: str = ""

    @property
    def dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes per token for the whole model (all layers, all heads)."""
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
        if self.is_mla:
            return layers * per_layer
        return layers * 2 * self.kv_heads_per_rank(tp) * per_layer

    def chunk_bytes_per_rank(self, chunk_tokens: int, tp: int = 1, pp: int = 1) -> int:
        return chunk_tokens * self.kv_bytes_per_token_per_rank(tp, pp)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

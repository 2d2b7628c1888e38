"""MLA models' KV geometry: the latent per layer and DeepSeek-V3.2's indexer cache (container-start process).

Read by ``autoconfig.model.kv`` for configs whose attention caches one
compressed latent per layer (DeepSeek V2/V3/V3.2, Kimi K2, Mistral Large 3
through ``params.json``). Pure: a config mapping in, numbers and one-line
reasons out. Each rule names the vLLM 0.32 code it mirrors.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmi_cache.errors import UserError
from lmi_cache.kv_layout import SideCache

# vllm/model_executor/models/deepseek_v2.py Indexer.__init__: quant_block_size = 128, and the
# indexer's K cache holds head_dim fp8 values plus one float32 (4 B) scale per 128 of them, as uint8.
INDEXER_QUANT_BLOCK = 128
INDEXER_SCALE_BYTES = 4


# vllm/model_executor/layers/attention/mla_attention.py MLAAttention.get_kv_cache_spec: state_content_bytes
# of the packed DeepSeek formats (512 fp8 values + 4 float32 scales + 64 bf16 RoPE values = 656 B per token).
FP8_DS_MLA_BYTES = 656
_FP8_DTYPES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"})


@dataclass(frozen=True)
class MlaGeometry:
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim: the one vector a layer caches per token
    side_caches: tuple[SideCache, ...]
    notes: tuple[str, ...]


IntKey = Callable[[Mapping[str, Any], tuple[str, ...], str, str], int]


def mla_geometry(text: Mapping[str, Any], prefix: str, source: str, model_type: str, num_layers: int,
                 int_key: IntKey) -> MlaGeometry:
    """The latent and side caches vLLM allocates per layer of an MLA model.

    ``int_key(section, names, prefix, source)`` reads a positive integer key (kv.py's bounds and messages).
    """
    kv_lora_rank = int_key(text, ("kv_lora_rank",), prefix, source)
    rope_dim = int_key(text, ("qk_rope_head_dim",), prefix, source)
    latent = kv_lora_rank + rope_dim
    # vllm/model_executor/layers/attention/mla_attention.py MLAAttention.get_kv_cache_spec:
    # MLAAttentionSpec(num_kv_heads=1, max_tp_shards=1, head_size=kv_lora_rank + qk_rope_head_dim).
    notes = [f"MLA ({model_type}): one latent of kv_lora_rank {kv_lora_rank} + qk_rope_head_dim {rope_dim} "
             f"= {latent} per layer, no separate K and V, replicated on every TP rank"]
    sides: tuple[SideCache, ...] = ()
    if "index_topk" in text:
        indexer = indexer_cache(text, prefix, source, num_layers, int_key)
        sides = (indexer,)
        notes.append(
            f"sparse attention indexer ('{prefix}index_topk' is set; vLLM deepseek_v2.py DeepseekV2MLAAttention "
            f"builds an Indexer): its K cache (DeepseekV32IndexerCache.get_kv_cache_spec) holds "
            f"{indexer.bytes_per_token_per_layer} B per token on {indexer.num_layers} of {num_layers} layers "
            f"(index_head_dim fp8 values + a {INDEXER_SCALE_BYTES} B scale per {INDEXER_QUANT_BLOCK}, uint8 "
            "whatever kv_cache_dtype), replicated on every TP rank, in the same KV cache group as the latent"
        )
    return MlaGeometry(latent_dim=latent, side_caches=sides, notes=tuple(notes))


def packed_latent(kv_dtype: str, sparse: bool) -> tuple[int, str] | None:
    """(bytes per token, reason) when vLLM stores the latent in the packed fp8_ds_mla row; None otherwise.

    Explicit ``fp8_ds_mla`` always is; a sparse-attention model (an indexer) with an fp8 KV cache is too, because
    vLLM's sparse MLA backend turns any quantized dtype into it (``_canonicalize_sparse_mla_kv_cache_dtype``
    for FLASHMLA_SPARSE, the backend for DeepSeek-V3.2 on Hopper; Blackwell's FLASHINFER_MLA_SPARSE keeps plain
    fp8, which this over-counts by 80 B per token per layer).
    """
    if kv_dtype == "fp8_ds_mla" or (sparse and kv_dtype in _FP8_DTYPES):
        why = "set explicitly" if kv_dtype == "fp8_ds_mla" else (
            f"vLLM's FLASHMLA_SPARSE backend (Hopper) stores kv_cache_dtype {kv_dtype} as fp8_ds_mla; assumed, "
            "Blackwell's FLASHINFER_MLA_SPARSE keeps 1 B per value")
        return FP8_DS_MLA_BYTES, (f"MLA latent packed as fp8_ds_mla ({why}): 512 fp8 values + 4 float32 scales "
                                  f"+ 64 bf16 RoPE values = {FP8_DS_MLA_BYTES} B per token per layer")
    return None


def indexer_cache(text: Mapping[str, Any], prefix: str, source: str, num_layers: int,
                  int_key: IntKey) -> SideCache:
    """DeepSeek-V3.2's indexer keys: which layers hold them and their bytes per token per layer."""
    head_dim = int_key(text, ("index_head_dim",), prefix, source)
    # Indexer.__init__: DeepseekV32IndexerCache(head_dim=head_dim + head_dim // quant_block_size * 4, uint8).
    per_layer = head_dim + head_dim // INDEXER_QUANT_BLOCK * INDEXER_SCALE_BYTES
    layers = sum(1 for layer in range(num_layers) if _layer_has_indexer(text, prefix, source, layer))
    return SideCache(name="indexer keys", num_layers=layers, bytes_per_token_per_layer=per_layer)


def _layer_has_indexer(text: Mapping[str, Any], prefix: str, source: str, layer: int) -> bool:
    """DeepseekV2MLAAttention.__init__'s skip rule (IndexCache): index_topk_pattern, else index_topk_freq."""
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, (str, list)):
            raise MlaConfigError(f"{source}: '{prefix}index_topk_pattern' must be a string or list of layer "
                                 f"marks, got {type(pattern).__name__}; fix the config")
        return not (layer < len(pattern) and pattern[layer] == "S")
    freq = text.get("index_topk_freq", 1)
    offset = text.get("index_skip_topk_offset", 2)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (freq, offset)) or freq < 1:
        raise MlaConfigError(f"{source}: '{prefix}index_topk_freq' must be a positive integer and "
                             f"'{prefix}index_skip_topk_offset' an integer; fix the config")
    return max(layer - offset + 1, 0) % freq == 0


class MlaConfigError(UserError):
    """An MLA config whose indexer keys cannot be read."""

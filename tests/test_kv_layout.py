"""KvLayout arithmetic: bytes per token for the model and per TP/PP rank."""
from __future__ import annotations

from lmi_cache.kv_layout import KvLayout


def test_gqa_bytes_per_token_and_tp_split() -> None:
    # Llama 3.1 8B: 32 layers, 8 KV heads, head_dim 128, bf16.
    layout = KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, kv_dtype="bfloat16")
    assert layout.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert layout.kv_bytes_per_token_per_rank(tp=8) == 32 * 2 * 1 * 128 * 2
    # TP 16 > 8 KV heads: vLLM replicates, one head per rank.
    assert layout.kv_bytes_per_token_per_rank(tp=16) == 32 * 2 * 1 * 128 * 2
    # PP 3 over 32 layers: the fullest stage has 11 layers.
    assert layout.kv_bytes_per_token_per_rank(tp=2, pp=3) == 11 * 2 * 4 * 128 * 2


def test_mla_latent_is_replicated_on_every_tp_rank() -> None:
    layout = KvLayout(num_layers=61, num_kv_heads=1, head_dim=512 + 64, kv_dtype="bfloat16", is_mla=True)
    assert layout.kv_bytes_per_token == 61 * 576 * 2
    assert layout.kv_bytes_per_token_per_rank(tp=8) == layout.kv_bytes_per_token
    assert layout.chunk_bytes_per_rank(256, tp=8) == 256 * 61 * 576 * 2

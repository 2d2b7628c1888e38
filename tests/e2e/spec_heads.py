"""Tiny random EAGLE draft heads for the tiny Llama of ``lmi_cache.devtools.tiny_model`` (test process).

vLLM's ``EagleLlamaForCausalLM`` (``vllm/model_executor/models/llama_eagle.py``)
reads a Llama ``config.json`` (``EAGLEConfig`` renames its architecture) and a
checkpoint without the ``model.`` prefix: ``fc.weight`` (hidden x 2*hidden, the
token embedding and the target's hidden state side by side) and
``layers.0.*`` of one decoder layer whose input norm is dropped. The embedding
and output head are shared with the target when the checkpoint has none.

``Eagle3LlamaForCausalLM`` (``llama_eagle3.py``) reads ``fc.weight`` over three
of the target's hidden states (hidden x 3*hidden), one ``midlayer.*`` decoder
layer whose attention reads the embedding and the hidden state side by side
(q/k/v over 2*hidden, with ``hidden_norm``), and a final ``norm``.
"""
from __future__ import annotations

import json
from pathlib import Path


def make_eagle_head(target_dir: Path, out_dir: Path, seed: int = 0, init_std: float = 0.12, eagle3: bool = False) -> Path:
    """Write a one-layer EAGLE (or EAGLE-3) head shaped like ``target_dir``'s Llama into ``out_dir`` (reused when
    present)."""
    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "model.safetensors").exists():
        return out_dir
    config = json.loads((target_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * init_std

    layer = "midlayer" if eagle3 else "layers.0"
    attn_in = 2 * hidden if eagle3 else hidden
    weights = {
        "fc.weight": rand(hidden, (3 if eagle3 else 2) * hidden),
        f"{layer}.self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
        f"{layer}.self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
        f"{layer}.self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
        f"{layer}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{layer}.post_attention_layernorm.weight": torch.ones(hidden),
        f"{layer}.mlp.gate_proj.weight": rand(inter, hidden),
        f"{layer}.mlp.up_proj.weight": rand(inter, hidden),
        f"{layer}.mlp.down_proj.weight": rand(hidden, inter),
    }
    if eagle3:
        weights.update({f"{layer}.input_layernorm.weight": torch.ones(hidden),
                        f"{layer}.hidden_norm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden)})
    save_file(weights, str(out_dir / "model.safetensors"))
    head_config = {**config, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    (out_dir / "config.json").write_text(json.dumps(head_config, indent=1))
    return out_dir

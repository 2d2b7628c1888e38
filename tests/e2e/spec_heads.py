"""Tiny random drafters for the speculative-decoding e2e tests: EAGLE and EAGLE-3 heads for the tiny Llama of
``lmi_cache.devtools.tiny_model``, and a MiMo-shaped model with one MTP layer (test process).

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

``MiMoForCausalLM`` is Qwen2 plus ``model.mtp_layers.0.*`` in the same
checkpoint (``mimo_mtp.py``): with ``"method": "mtp"`` vLLM loads that layer
as the drafter (its attention layer is numbered after the target's).
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


def make_tiny_mimo(tokenizer_dir: Path, out_dir: Path, seed: int = 0, init_std: float = 0.12) -> Path:
    """A random MiMo-shaped model (Qwen2 layers plus one MTP layer) in the 7m shape, with the tokenizer of
    ``tokenizer_dir``; vLLM serves it with ``"method": "mtp"``, its MTP layer as the drafter."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "model.safetensors").exists():
        return out_dir
    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384,
                         initializer_range=init_std, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config.dtype = "float32"
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).float().save_pretrained(str(out_dir), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    hidden, inter, head_dim = 256, 688, 32
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * init_std

    weights = load_file(str(out_dir / "model.safetensors"))
    mtp = "model.mtp_layers.0."
    weights.update({
        mtp + "token_layernorm.weight": torch.ones(hidden), mtp + "hidden_layernorm.weight": torch.ones(hidden),
        mtp + "final_layernorm.weight": torch.ones(hidden), mtp + "input_proj.weight": rand(hidden, 2 * hidden),
        mtp + "input_layernorm.weight": torch.ones(hidden), mtp + "post_attention_layernorm.weight": torch.ones(hidden),
        mtp + "self_attn.q_proj.weight": rand(8 * head_dim, hidden), mtp + "self_attn.q_proj.bias": rand(8 * head_dim),
        mtp + "self_attn.k_proj.weight": rand(2 * head_dim, hidden), mtp + "self_attn.k_proj.bias": rand(2 * head_dim),
        mtp + "self_attn.v_proj.weight": rand(2 * head_dim, hidden), mtp + "self_attn.v_proj.bias": rand(2 * head_dim),
        mtp + "self_attn.o_proj.weight": rand(hidden, 8 * head_dim),
        mtp + "mlp.gate_proj.weight": rand(inter, hidden), mtp + "mlp.up_proj.weight": rand(inter, hidden),
        mtp + "mlp.down_proj.weight": rand(hidden, inter),
    })
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config_dict = json.loads((out_dir / "config.json").read_text())
    config_dict.update({"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1})
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=1))
    return out_dir

